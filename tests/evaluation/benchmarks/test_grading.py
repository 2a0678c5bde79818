"""The grader bundle a Kubernetes grader Job unpacks over its root, and its checked write."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from mass_ops.evaluation.benchmarks.grading import GraderJob, grader_bundle, write_grader_bundle
from mass_ops.evaluation.benchmarks.scoring import BenchmarkError

JOB = GraderJob("swe", "x-1", "img:1", "true", {"/tmp/b.patch": b"diff\n", "/tests/test.sh": b"echo 1\n"})


def test_bundle_holds_each_file_at_its_target_and_is_deterministic():
    data = grader_bundle(JOB)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        members = {m.name: archive.extractfile(m).read() for m in archive.getmembers()}
    assert members == {"tests/test.sh": b"echo 1\n", "tmp/b.patch": b"diff\n"}
    assert grader_bundle(JOB) == data


def test_bundle_is_written_only_when_its_hash_matches(tmp_path):
    data = grader_bundle(JOB)
    out = tmp_path / "in" / "bundle.tar"
    with pytest.raises(BenchmarkError, match="is not the expected") as caught:
        write_grader_bundle(data, "0" * 64, out)
    assert "\n" not in str(caught.value) and not out.parent.exists()
    write_grader_bundle(data, hashlib.sha256(data).hexdigest(), out)
    assert out.read_bytes() == data and [p.name for p in out.parent.iterdir()] == ["bundle.tar"]
