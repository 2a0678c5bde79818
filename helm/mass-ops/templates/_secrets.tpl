{{/*
Which environment variable comes from which Secret group, whether the Secret may lack it, and which workloads get
it. Least privilege is decided here, not in values: the sandbox container of an episode pod (which runs an agent's
arbitrary commands) gets no secret at all; the pod's proxy container (consumer `proxy`) gets the inference key and
adds it to the agent's requests; the publisher container gets the store and database credentials to publish the
episode, and no key; judge keys stay with the Airflow workers that make judge calls.
*/}}
{{- define "mass-ops.secretEnvTable" -}}
MASS_METADATA_URL: {group: metadata, optional: false, consumers: [airflow, training, publisher]}
AWS_ACCESS_KEY_ID: {group: s3, optional: false, consumers: [airflow, training, publisher]}
AWS_SECRET_ACCESS_KEY: {group: s3, optional: false, consumers: [airflow, training, publisher]}
AWS_ENDPOINT_URL_S3: {group: s3, optional: true, consumers: [airflow, training, publisher]}
OPENAI_API_KEY: {group: judges, optional: true, consumers: [airflow]}
ANTHROPIC_API_KEY: {group: judges, optional: true, consumers: [airflow]}
VLLM_API_KEY: {group: inference, optional: true, consumers: [airflow, proxy, inference]}
{{- end }}

{{/* env name -> {secretName, key, optional, consumers}: what an operator turns into a secretKeyRef. */}}
{{- define "mass-ops.secretRefs" -}}
{{- $table := include "mass-ops.secretEnvTable" . | fromYaml }}
{{- $refs := dict }}
{{- range $env, $spec := $table }}
{{- $group := index $.Values.secrets $spec.group }}
{{- $key := default $env (index $group.keys $env) }}
{{- $_ := set $refs $env (dict "secretName" $group.name "key" $key "optional" $spec.optional "consumers" $spec.consumers) }}
{{- end }}
{{- toYaml $refs }}
{{- end }}
