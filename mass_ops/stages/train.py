"""The train and select-checkpoint stages (MASS_SPEC §1 train/export, §8).

- `train`: LoRA SFT of the parent on the rendered windows (local backend: torchrun of `mass_ops.train.trainer`);
  every checkpoint is published under `cycles/<cycle>/training/step_NNNNN/` as soon as it appears and recorded with
  its losses; a rerun after a crash resumes from the newest published checkpoint.
- `select_checkpoint`: minimum validation loss over saved steps > 0, frozen in `selected_checkpoint.json`.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mass_ops.compute import processes
from mass_ops.compute.backend import backend_for
from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext, attach_cycle
from mass_ops.layout import (
    training_prefix,
)
from mass_ops.stages.common import SPLITS, TRAINING_RUN_KEY, PostTrainingError, refuse_remote
from mass_ops.stages.render import local_shard
from mass_ops.store.model_folders import (
    MANIFEST_NAME,
    fetch_model,
    publish_model,
    resolve_model_location,
)
from mass_ops.store.schema import Dataset, RunStatus, TrainingRun
from mass_ops.train.checkpoints import (
    CRITERION,
    SELECTION_FILE,
    TRAIN_LOG_FILE,
    CheckpointSelectionError,
    finite_number,
    is_complete,
    log_rows,
    read_train_log,
)
from mass_ops.train.plan import train_args_for, training_command_for

logger = logging.getLogger(__name__)

# Layout of the local training folder. Paths in the trainer's args are relative to it, so the args (and the
# trajectory check a resume makes against them) are the same whichever machine or folder runs the job.
PARENT_DIR = "parent"
DATA_FILES = {"train": "data/train.jsonl", "val": "data/val.jsonl"}
OUT_DIR = "training"
ARGS_FILE = "train_args.json"
STDOUT_LOG = "train_stdout.log"
# Trainer outputs copied to the store next to the checkpoints (the trainer's own file names).
# lora_targets.json: the modules LoRA adapted, by kind, and the adapter's parameter count (written at start).
LOG_FILES = (TRAIN_LOG_FILE, "exposure_log.jsonl", "resume_log.jsonl", "args.json", "lora_targets.json")
POLL_S = 1.0
STOP_GRACE_S = 30.0
# The training job's process group, recorded in the work folder while it runs.
TRAINER_PGID_FILE = "trainer.pgid"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the mass_ops package
_PUBLISHED_CHECKPOINT = re.compile(r"step_(\d{5})/" + re.escape(MANIFEST_NAME))


def _training_run(ctx: CycleContext) -> TrainingRun | None:
    # Read, never `ensure_training_run`: looking at the run must not create it as a side effect.
    return ctx.repo.get_training_run(ctx.cycle_id, TRAINING_RUN_KEY)


def rendered_datasets(ctx: CycleContext, stage: str) -> dict[str, Dataset]:
    datasets = {}
    for split in SPLITS:
        dataset = ctx.repo.get_dataset(ctx.cycle_id, split)
        if dataset is None:
            raise PostTrainingError(
                f"{stage}: cycle {ctx.cycle_name} has no rendered {split} dataset; run render first"
            )
        datasets[split] = dataset
    return datasets


def _run_spec(config: CycleConfig, parent_uri: str, datasets: Mapping[str, Dataset]) -> dict[str, Any]:
    """What defines the training run: the trainer's knobs (machine-independent paths), its inputs and world size."""
    args = train_args_for(
        config, model_dir=PARENT_DIR, train_data=DATA_FILES["train"], val_data=DATA_FILES["val"], out_dir=OUT_DIR
    ).to_dict()
    for machine_specific in ("resume_from", "accelerator"):
        args.pop(machine_specific)
    return {
        "trainer": args,
        "parent": parent_uri,
        "datasets": {split: {"id": d.id, "uri": d.uri} for split, d in datasets.items()},
        "world_size": config.training.replicas,
    }


@contextlib.contextmanager
def _scratch(workdir: str | os.PathLike[str] | None, prefix: str) -> Iterator[Path]:
    if workdir is not None:
        path = Path(workdir).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
            yield Path(scratch)


def _stage_parent(ctx: CycleContext, root: Path) -> None:
    """Make `root/parent` the parent model: downloaded there, or a link to a local folder used in place."""
    dest = root / PARENT_DIR
    if dest.is_symlink():
        dest.unlink()
    folder = fetch_model(ctx.artifacts, ctx.config.models.parent_bf16, dest)
    if folder != dest:
        if dest.exists():
            shutil.rmtree(dest)
        dest.symlink_to(folder, target_is_directory=True)


def _stage_dataset(ctx: CycleContext, dataset: Dataset, dest: Path) -> None:
    """Concatenate a dataset's shards into the one JSONL file the trainer reads (temp file, then rename)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    temp = dest.with_name(dest.name + ".partial")
    count = 0
    with temp.open("wb") as out:
        for shard in (dataset.stats or {}).get("shards", []):
            with local_shard(ctx, shard) as path, gzip.open(path, "rb") as lines:
                for line in lines:
                    out.write(line)
                    count += 1
    if count != dataset.windows:
        temp.unlink()
        raise PostTrainingError(
            f"dataset {dataset.uri}: its shards hold {count} windows, its row says {dataset.windows}"
        )
    os.replace(temp, dest)


def log_key(cycle: str, name: str) -> str:
    return f"{training_prefix(cycle)}/{name}"


def _checkpoint_key(cycle: str, step: int) -> str:
    return f"{training_prefix(cycle)}/step_{step:05d}"


def _published_checkpoints(ctx: CycleContext, run_id: int) -> dict[int, str]:
    """Checkpoints of the run that are durable: recorded in the run's rows, or published to the store by an attempt
    that stopped before recording them (their rows follow at the next record)."""
    found = {c.step: c.uri for c in ctx.repo.checkpoints(run_id) if c.uri}
    prefix = training_prefix(ctx.cycle_name)
    for key in ctx.artifacts.list(f"{prefix}/step_"):
        match = _PUBLISHED_CHECKPOINT.fullmatch(key.removeprefix(f"{prefix}/"))
        if match is not None:
            found.setdefault(int(match.group(1)), ctx.artifacts.uri(key.rpartition("/")[0]))
    return found


def _restore_progress(ctx: CycleContext, published: Mapping[int, str], out_dir: Path) -> Path:
    """Put the run's published logs and its newest checkpoint into `out_dir`; return the checkpoint to resume from."""
    for name in LOG_FILES:
        key = log_key(ctx.cycle_name, name)
        if ctx.artifacts.exists(key):
            ctx.artifacts.get_file(key, out_dir / name)
    step = max(published)
    folder = fetch_model(ctx.artifacts, published[step], out_dir / f"step_{step:05d}")
    if not is_complete(folder):
        raise PostTrainingError(f"checkpoint {published[step]} is incomplete; it cannot be resumed from")
    logger.info("resuming training from step %d (%s)", step, published[step])
    return folder


def _read_log_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL log the trainer may be appending to: a last line without its newline is not read yet."""
    if not path.is_file():
        return []
    try:
        return log_rows(path.read_text(encoding="utf-8"), str(path), complete_lines_only=True)
    except CheckpointSelectionError as exc:
        raise PostTrainingError(str(exc)) from None


class _TrainingProgress:
    """Publishes checkpoints as the trainer writes them, then the logs, then records the rows (in that order).

    Log rows are recorded only up to the newest published checkpoint: a resume starts from there, so those rows are
    final and a rerun never meets a recorded value it would compute differently.
    """

    def __init__(self, ctx: CycleContext, run_id: int, out_dir: Path, published: Mapping[int, str]) -> None:
        self.ctx = ctx
        self.run_id = run_id
        self.out_dir = out_dir
        self.published = dict(published)
        self.manifest_sha256: dict[int, str] = {}  # step → SHA-256 of its manifest.json (which hashes every file)
        self.log_sha256: str | None = None  # of the train log as last published
        self._lock = threading.Lock()

    def poll(self) -> None:
        with self._lock:
            new = self._publish_checkpoints()
            if new:
                self.publish_logs()
                self._record(max(self.published))

    def finish(self, stdout_log: Path) -> None:
        with self._lock:
            self._publish_checkpoints()
            self.publish_logs(stdout_log)
            if self.published:
                self._record(max(self.published))

    def _publish_checkpoints(self) -> list[int]:
        new = []
        for folder in sorted(self.out_dir.glob("step_[0-9][0-9][0-9][0-9][0-9]")):
            step = int(folder.name.removeprefix("step_"))
            if step in self.published or not folder.is_dir() or not is_complete(folder):
                continue
            published = publish_model(self.ctx.artifacts, _checkpoint_key(self.ctx.cycle_name, step), folder)
            self.published[step] = published.uri
            new.append(step)
        return new

    def publish_logs(self, stdout_log: Path | None = None) -> None:
        """Copy the trainer's logs to the store, whole lines only: the trainer may be appending, and a resume parses
        every line of the copy it restores."""
        sources = [self.out_dir / name for name in LOG_FILES]
        if stdout_log is not None:
            sources.append(stdout_log)
        for path in sources:
            if path.is_file():
                data = path.read_bytes()
                info = self.ctx.artifacts.put_bytes(
                    log_key(self.ctx.cycle_name, path.name), data[: data.rfind(b"\n") + 1]
                )
                if path.name == TRAIN_LOG_FILE:
                    self.log_sha256 = info.sha256

    def _record(self, through: int) -> None:
        fields: dict[int, dict[str, Any]] = {}
        for row in _read_log_rows(self.out_dir / TRAIN_LOG_FILE):
            step = row.get("step")
            if isinstance(step, bool) or not isinstance(step, int) or step > through:
                continue
            if "val_loss" in row:
                entry = fields.setdefault(step, {})
                if finite_number(row["val_loss"]):
                    entry["val_loss"] = float(row["val_loss"])
                else:  # kept out of the row; select_checkpoint reads the log and refuses the run
                    logger.warning("step %d: non-finite validation loss %r", step, row["val_loss"])
                if finite_number(row.get("val_tokens")):
                    entry["val_tokens"] = int(row["val_tokens"])
            elif "loss" in row and step in self.published and finite_number(row["loss"]):
                fields.setdefault(step, {})["train_loss"] = float(row["loss"])
        for step, uri in self.published.items():
            if step <= through:
                fields.setdefault(step, {}).update(uri=uri, sha256=self._manifest_sha256(step))
        for step, values in sorted(fields.items()):
            self.ctx.repo.record_checkpoint(self.run_id, step, **values)

    def _manifest_sha256(self, step: int) -> str:
        if step not in self.manifest_sha256:
            key = f"{_checkpoint_key(self.ctx.cycle_name, step)}/{MANIFEST_NAME}"
            self.manifest_sha256[step] = self.ctx.artifacts.info(key).sha256
        return self.manifest_sha256[step]


def _default_accelerator() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _training_env(config: CycleConfig, accelerator: str) -> dict[str, str]:
    """The trainer's environment: ours without the API keys it has no use for, plus the CPU/DeepSpeed settings."""
    secrets = {config.inference.api_key_env, *(judge.api_key_env for judge in config.evaluation.judges)}
    env = {name: value for name, value in os.environ.items() if name not in secrets}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    # The trainer's tools come from its own environment: DeepSpeed JIT-builds its ops with the first `ninja` on PATH,
    # and a system ninja of another version rewrites the build log and rebuilds an op the other one had cached.
    tools = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([tools, *(p for p in env.get("PATH", "").split(os.pathsep) if p and p != tools)])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        # Ranks share the cores; without a cap every rank starts one thread per core and they thrash.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.training.ranks_per_node)))
    return env


def _stop_leftover_trainer(root: Path) -> None:
    """Stop a training job that a killed earlier run of this stage left in the same work folder (its process group is
    recorded there), so that it neither runs on nor writes into the folder this run prepares."""
    record = root / TRAINER_PGID_FILE
    try:
        pgid = int(record.read_text().strip())
    except (OSError, ValueError):
        return
    processes.stop_group(pgid, grace_s=STOP_GRACE_S, kill_wait_s=STOP_GRACE_S)
    logger.warning("stopped the training job (process group %d) a killed earlier run left in %s", pgid, root)
    record.unlink(missing_ok=True)


def _run_training(
    command: Sequence[str], cwd: Path, env: Mapping[str, str], stdout_log: Path, progress: _TrainingProgress
) -> tuple[int, list[str]]:
    """Run the launcher, streaming its output to our log and `stdout_log`, publishing checkpoints as they appear."""
    tail: deque[str] = deque(maxlen=40)
    logger.info("launching training: %s", " ".join(command))
    with stdout_log.open("a", encoding="utf-8") as out:
        # Its own session, so that a stop ends the launcher with its ranks; and SIGTERM when this stage dies (an
        # Airflow task or the OOM killer's SIGKILL), so the job neither holds the accelerators nor writes into the
        # folder a rerun uses: torchrun stops its ranks on SIGTERM.
        process = processes.start_in_session(
            command, stdout=subprocess.PIPE, stdin=None, cwd=cwd, env=env, text=True, bufsize=1, die_with_parent=True
        )
        # A rerun in the same work folder stops this job if the stage dies in a way no signal reaches it.
        (cwd / TRAINER_PGID_FILE).write_text(f"{process.pid}\n")

        def pump() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                out.write(line)
                out.flush()
                text = line.rstrip()
                if text:
                    tail.append(text)
                    logger.info("train | %s", text)

        reader = threading.Thread(target=pump, name="train-log", daemon=True)
        reader.start()
        try:
            while True:
                try:
                    process.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    progress.poll()
        except BaseException:
            processes.stop_child(process, grace_s=STOP_GRACE_S)
            raise
        reader.join()
    return process.returncode, list(tail)


def _checkpoint_rows(ctx: CycleContext, run_id: int) -> list[dict[str, Any]]:
    return [
        {"step": c.step, "uri": c.uri, "train_loss": c.train_loss, "val_loss": c.val_loss, "val_tokens": c.val_tokens}
        for c in ctx.repo.checkpoints(run_id)
    ]


def _training_summary(
    ctx: CycleContext, run: TrainingRun, *, reused: bool, resumed_from: int | None = None
) -> dict[str, Any]:
    return {
        "run_id": run.id,
        "status": run.status,
        "steps": ctx.config.training.steps,
        "train_log_uri": run.log_uri,
        "output_uri": run.output_uri,
        "checkpoints": _checkpoint_rows(ctx, run.id),
        "resumed_from_step": resumed_from,
        "reused": reused,
    }


def train(
    config: CycleConfig, *, workdir: str | os.PathLike[str] | None = None, accelerator: str | None = None
) -> dict[str, Any]:
    """LoRA SFT of the parent on the rendered datasets (local backend), checkpoints published as they appear.

    `workdir` holds the staged parent, data and the run folder (a temporary folder when None); `accelerator` is
    "cpu" or "cuda" (default: cuda when available). A finished run is not started again (returns its summary); a
    run with published checkpoints resumes from the newest one.
    """
    refuse_remote(config, "train")
    if not backend_for(config).runs_in_process:
        raise PostTrainingError(
            f"train: compute.backend is {config.compute.backend}; this function launches the local backend only "
            "(on Kubernetes the training Job runs the same trainer command)"
        )
    if config.training.nnodes != 1:
        raise PostTrainingError(f"train: training.nnodes is {config.training.nnodes}; a local run uses one node")
    if accelerator not in (None, "cpu", "cuda"):
        raise PostTrainingError(f"train: accelerator must be cpu or cuda (got {accelerator!r})")
    ctx = attach_cycle(config)
    datasets = rendered_datasets(ctx, "train")
    parent_uri = resolve_model_location(ctx.artifacts, config.models.parent_bf16).uri
    run = ctx.repo.ensure_training_run(ctx.cycle_id, TRAINING_RUN_KEY, _run_spec(config, parent_uri, datasets))
    if run.status == RunStatus.SUCCEEDED:
        logger.info("training run %s of cycle %s already finished", TRAINING_RUN_KEY, ctx.cycle_name)
        return _training_summary(ctx, run, reused=True)
    device = accelerator or _default_accelerator()
    published = _published_checkpoints(ctx, run.id)
    with _scratch(workdir, "mass-train-") as root:
        _stop_leftover_trainer(root)
        out_dir = root / OUT_DIR
        shutil.rmtree(out_dir, ignore_errors=True)  # scratch: everything durable is in the stores
        out_dir.mkdir(parents=True)
        _stage_parent(ctx, root)
        for split, dataset in datasets.items():
            _stage_dataset(ctx, dataset, root / DATA_FILES[split])
        resume_from = _restore_progress(ctx, published, out_dir) if published else None
        args = train_args_for(
            config,
            model_dir=PARENT_DIR,
            train_data=DATA_FILES["train"],
            val_data=DATA_FILES["val"],
            out_dir=OUT_DIR,
            accelerator=device,
            resume_from=resume_from,
        )
        args.write(root / ARGS_FILE)
        command = training_command_for(config, ARGS_FILE, python=sys.executable)
        output_uri = ctx.artifacts.uri(training_prefix(ctx.cycle_name))
        ctx.repo.set_training_run_status(run.id, RunStatus.RUNNING, output_uri=output_uri)
        progress = _TrainingProgress(ctx, run.id, out_dir, published)
        stdout_log = root / STDOUT_LOG
        try:
            code, tail = _run_training(command, root, _training_env(config, device), stdout_log, progress)
            progress.finish(stdout_log)
        except BaseException:
            with contextlib.suppress(Exception):  # best effort: the logs help whoever looks at the failure
                progress.publish_logs(stdout_log)
            ctx.repo.set_training_run_status(run.id, RunStatus.FAILED)
            raise
        log_uri = ctx.artifacts.uri(log_key(ctx.cycle_name, TRAIN_LOG_FILE))
        if code != 0:
            ctx.repo.set_training_run_status(run.id, RunStatus.FAILED, log_uri=log_uri, log_sha256=progress.log_sha256)
            last = tail[-1] if tail else "no output"
            raise PostTrainingError(f"train: the training job exited with status {code}: {last}")
        if config.training.steps not in progress.published:
            ctx.repo.set_training_run_status(run.id, RunStatus.FAILED, log_uri=log_uri)
            raise PostTrainingError(
                f"train: the job finished without a checkpoint at the last step {config.training.steps}"
            )
        run = ctx.repo.set_training_run_status(
            run.id, RunStatus.SUCCEEDED, log_uri=log_uri, log_sha256=progress.log_sha256
        )
    return _training_summary(ctx, run, reused=False, resumed_from=max(published) if published else None)


# =====================================================================================================================
# select checkpoint


def finished_run(ctx: CycleContext, stage: str) -> TrainingRun:
    run = _training_run(ctx)
    if run is None or run.status != RunStatus.SUCCEEDED:
        state = "no training run" if run is None else f"training run {run.key} is {run.status}"
        raise PostTrainingError(f"{stage}: cycle {ctx.cycle_name} has {state}; run the train stage first")
    return run


def select_checkpoint(config: CycleConfig) -> dict[str, Any]:
    """The checkpoint of minimum validation loss over saved steps > 0 (ties: earlier step), frozen in
    `selected_checkpoint.json` next to the checkpoints.

    The published training log is checked as the reference checks it: a non-finite validation loss or a validation
    without tokens is an error; its choice must agree with the checkpoint rows.
    """
    refuse_remote(config, "select_checkpoint")
    ctx = attach_cycle(config)
    run = finished_run(ctx, "select_checkpoint")
    rows = {c.step: c for c in ctx.repo.checkpoints(run.id)}
    train_log_key = log_key(ctx.cycle_name, TRAIN_LOG_FILE)
    log_uri = ctx.artifacts.uri(train_log_key)
    with tempfile.TemporaryDirectory(prefix="mass-select-") as scratch:
        path = Path(scratch) / TRAIN_LOG_FILE
        ctx.artifacts.get_file(train_log_key, path)
        try:
            log = read_train_log(path)
        except CheckpointSelectionError as exc:
            raise PostTrainingError(f"select_checkpoint: {log_uri}: {exc}") from None
    candidates = []
    for row in log:
        if "val_loss" not in row:
            continue
        # An absent token count reads as 0: refused below as a validation that counted no tokens.
        step, loss, tokens = row.get("step"), row["val_loss"], row.get("val_tokens", 0)
        if not finite_number(loss):
            raise PostTrainingError(f"select_checkpoint: {log_uri}: validation loss at step {step} is not finite")
        if not finite_number(tokens) or tokens <= 0:
            raise PostTrainingError(f"select_checkpoint: {log_uri}: validation at step {step} counted no tokens")
        if isinstance(step, int) and not isinstance(step, bool) and step > 0 and step in rows and rows[step].uri:
            candidates.append((float(loss), step))
    if not candidates:
        raise PostTrainingError(f"select_checkpoint: {log_uri}: no validated step > 0 has a published checkpoint")
    val_loss, step = min(candidates)
    best = ctx.repo.best_checkpoint(run.id)
    if best is None or best.step != step:
        raise PostTrainingError(
            f"select_checkpoint: the training log selects step {step}, the checkpoint rows of run {run.id} select "
            f"{best.step if best else 'nothing'}"
        )
    choice = {
        "step": step,
        "val_loss": val_loss,
        "checkpoint": best.uri,
        "criterion": CRITERION,
        "checkpoint_id": best.id,
        "run_id": run.id,
    }
    key = log_key(ctx.cycle_name, SELECTION_FILE)
    if ctx.artifacts.exists(key):
        stored = ctx.artifacts.get_json(key)
        if stored != choice:
            raise PostTrainingError(
                f"select_checkpoint: {ctx.artifacts.uri(key)} already records step {stored.get('step')}; the "
                f"records now select step {step} (a cycle's selection never changes)"
            )
    else:
        ctx.artifacts.put_json(key, choice)
    return {**choice, "selection_uri": ctx.artifacts.uri(key)}


def run_train(config: CycleConfig, *, workdir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """The `train` command: one row per recorded step (checkpoints and validations)."""
    summary = train(config, workdir=workdir)
    return [{"run": summary["run_id"], **row} for row in summary["checkpoints"]]
