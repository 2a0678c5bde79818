"""The hand-off between the containers of a Kubernetes episode pod: the sandbox runs, the publisher publishes.

The sandbox container holds the inference key and nothing else; the store credentials live in the publisher, which
shares one folder (an emptyDir) with it and nothing more. Everything in that folder is the agent's to write, swap or
delete, so the publisher takes identity and keys from what the sandbox announced before any agent ran, and opens
each file once, following no link. This facade re-exports the public names of its modules; the folder's layout,
the sequence, the trust model, proxy sessions, budgets and leases: docs/handoff.md.

- `folder`: file names, timings, errors, `Handoff` (atomic writes, link-free reads), `Heartbeat`;
- `documents`: the JSON documents both sides exchange;
- `sandbox`, `sandbox_stores`: the sandbox's end and the stores as its pool sees them (from the ledger);
- `delivery`, `publisher`, `proxy_sessions`, `spend`: the publisher's end, what it hands over before the agent
  starts, the attempts' proxy sessions, and the budget charges.
"""

from mass_ops.runtime.handoff.delivery import PromptDelivery, PromptDeliveryError, SeedDeliveryError
from mass_ops.runtime.handoff.documents import (
    FORMAT,
    Ack,
    AttemptHandoff,
    Completion,
    HandoffRequest,
    HandoffUnit,
    Ledger,
    PublisherFailure,
    RecordedAttempt,
    ScopeSpend,
    ServingTarget,
    SessionClosed,
    SessionGrant,
)
from mass_ops.runtime.handoff.folder import (
    ATTEMPT_FILES,
    COMPLETE_FILE,
    DEFAULT_STALE_AFTER_S,
    DEFAULT_START_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    LEDGER_FILE,
    POLL_S,
    PROMPT_FILE,
    PROMPT_MAX_BYTES,
    PUBLICATION_FILE,
    PUBLISHER_ALIVE,
    PUBLISHER_FAILED_FILE,
    REQUEST_FILE,
    SANDBOX_ALIVE,
    SEED_FILE,
    SESSIONS_DIR,
    Handoff,
    HandoffError,
    Heartbeat,
    IncompleteHandoffError,
)
from mass_ops.runtime.handoff.proxy_sessions import PodProxy, PublisherSessions
from mass_ops.runtime.handoff.publisher import CREDENTIAL_ENV, MIN_SCRUBBED, HandoffPublisher
from mass_ops.runtime.handoff.sandbox import HandoffProxySessions, HandoffSink, SandboxHandoff
from mass_ops.runtime.handoff.sandbox_stores import LedgerArtifacts, LedgerRepository
from mass_ops.runtime.handoff.spend import api_log_cost

__all__ = [
    "ATTEMPT_FILES",
    "COMPLETE_FILE",
    "CREDENTIAL_ENV",
    "DEFAULT_STALE_AFTER_S",
    "DEFAULT_START_TIMEOUT_S",
    "FORMAT",
    "HEARTBEAT_INTERVAL_S",
    "LEDGER_FILE",
    "MIN_SCRUBBED",
    "POLL_S",
    "PROMPT_FILE",
    "PROMPT_MAX_BYTES",
    "PUBLICATION_FILE",
    "PUBLISHER_ALIVE",
    "PUBLISHER_FAILED_FILE",
    "REQUEST_FILE",
    "SANDBOX_ALIVE",
    "SEED_FILE",
    "SESSIONS_DIR",
    "Ack",
    "AttemptHandoff",
    "Completion",
    "Handoff",
    "HandoffError",
    "HandoffProxySessions",
    "HandoffPublisher",
    "HandoffRequest",
    "HandoffSink",
    "HandoffUnit",
    "Heartbeat",
    "IncompleteHandoffError",
    "Ledger",
    "LedgerArtifacts",
    "LedgerRepository",
    "PodProxy",
    "PromptDelivery",
    "PromptDeliveryError",
    "PublisherFailure",
    "PublisherSessions",
    "RecordedAttempt",
    "SandboxHandoff",
    "ScopeSpend",
    "SeedDeliveryError",
    "ServingTarget",
    "SessionClosed",
    "SessionGrant",
    "api_log_cost",
]
