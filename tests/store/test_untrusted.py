"""The one bounded reader of untrusted bytes (store/untrusted.py): JSON, files beneath a folder, tar.gz archives."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from mass_ops.errors import InfrastructureError
from mass_ops.store.untrusted import (
    ARCHIVE_LIMITS,
    ArchiveLimits,
    ArchiveTooLargeError,
    UnsafeArchiveInputError,
    UntrustedInputError,
    extract_tar_gz,
    loads_untrusted,
    read_beneath,
    read_capped,
)
from tests.fixtures.archives import member, tar_gz, zero_bomb

# -- JSON ----------------------------------------------------------------------------------------------------------


def test_json_within_the_rules_is_parsed_from_bytes_or_text() -> None:
    assert loads_untrusted(b'{"a": [1, 2, {"b": null}]}', what="doc") == {"a": [1, 2, {"b": None}]}
    assert loads_untrusted('["é"]', what="doc") == ["é"]


@pytest.mark.parametrize(
    ("data", "kwargs", "message"),
    [
        (b'"' + b"x" * 100 + b'"', {"max_bytes": 64}, r"^doc: 102 bytes of JSON, over the 64-byte limit$"),
        ("[" * 200 + "]" * 200, {}, r"^doc: JSON nested deeper than 128 levels$"),
        ("[" * 10 + "]" * 10, {"max_depth": 3}, r"^doc: JSON nested deeper than 3 levels$"),
        (b"[" * 1_000_000 + b"]" * 1_000_000, {"max_bytes": 4 << 20}, r"^doc: JSON nested deeper than the parser"),
        (b'{"a": "\xff\xfe"}', {}, r"^doc: not UTF-8 \(byte 7\)$"),
        (b"{'a': 1}", {}, r"^doc: not JSON \("),
        (b"", {}, r"^doc: not JSON \("),
    ],
    ids=["size", "depth", "depth-cap", "parser-stack", "encoding", "syntax", "empty"],
)
def test_json_outside_the_rules_is_one_untrusted_input_error(data: bytes | str, kwargs: dict, message: str) -> None:
    with pytest.raises(UntrustedInputError, match=message) as refused:
        loads_untrusted(data, what="doc", **kwargs)
    assert "\n" not in str(refused.value)
    assert not isinstance(refused.value, RecursionError | UnicodeDecodeError)


# -- files beneath a folder ----------------------------------------------------------------------------------------


def test_a_regular_file_is_read_and_a_large_one_refused_before_reading(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.json").write_bytes(b"[1]")
    assert read_beneath(tmp_path, "sub/a.json", max_bytes=3) == b"[1]"
    huge = tmp_path / "huge"
    with huge.open("wb") as out:
        out.truncate(500 << 20)  # sparse: costs nothing, and must cost nothing to refuse
    with pytest.raises(UntrustedInputError, match=r"huge: 524,288,000 bytes, over the 1,024-byte limit"):
        read_beneath(tmp_path, "huge", max_bytes=1024)


def test_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(UntrustedInputError, match="pipe: not a regular file"):
        read_beneath(tmp_path, "pipe", max_bytes=10)


def test_links_anywhere_on_the_path_and_hard_links_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s3cret")
    root = tmp_path / "root"
    root.mkdir()
    (root / "file").symlink_to(outside / "secret")
    (root / "folder").symlink_to(outside)
    os.link(outside / "secret", root / "hard")
    with pytest.raises(UntrustedInputError, match="file is a link"):
        read_beneath(root, "file", max_bytes=100)
    with pytest.raises(UntrustedInputError, match="folder is a link"):
        read_beneath(root, "folder/secret", max_bytes=100)
    with pytest.raises(UntrustedInputError, match="2 hard links"):
        read_beneath(root, "hard", max_bytes=100)
    for escape in ("../outside/secret", "/etc/passwd"):
        with pytest.raises(UntrustedInputError, match="not a plain relative path"):
            read_beneath(root, escape, max_bytes=100)
    with pytest.raises(FileNotFoundError):
        read_beneath(root, "absent", max_bytes=100)


def test_read_capped_reads_a_head_and_a_tail_whatever_the_size(tmp_path: Path) -> None:
    big = tmp_path / "big"
    with big.open("wb") as out:  # 500 MB, sparse
        out.write(b"head")
        out.truncate(500_000_000)
        out.seek(500_000_000 - 4)
        out.write(b"tail")
    read = read_capped(big, head=16, tail=8)
    assert read is not None and (read.head[:4], read.tail[-4:], read.size) == (b"head", b"tail", 500_000_000)
    assert (len(read.head), len(read.tail), read.omitted) == (16, 8, 500_000_000 - 24)
    small = tmp_path / "small"
    small.write_bytes(b"0123456789")
    whole = read_capped(small, head=8, tail=2)
    assert whole is not None and (whole.head, whole.tail, whole.omitted) == (b"0123456789", b"", 0)
    os.mkfifo(tmp_path / "pipe")
    assert read_capped(tmp_path / "pipe", head=8) is None  # and the open did not hang
    assert read_capped(tmp_path / "absent", head=8) is None


# -- archives ------------------------------------------------------------------------------------------------------


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _disk_bytes(root: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*"))


def test_a_valid_archive_is_extracted_with_its_links_and_counted(tmp_path: Path) -> None:
    archive = tar_gz(
        tmp_path / "ok.tar.gz",
        [
            member("dir", kind=tarfile.DIRTYPE),
            member("dir/a.txt", b"alpha"),
            member("dir/link", kind=tarfile.SYMTYPE, linkname="a.txt"),
            member("dir/hard", kind=tarfile.LNKTYPE, linkname="dir/a.txt"),
        ],
    )
    assert extract_tar_gz(archive, tmp_path / "out", what="ok") == 4
    assert _tree(tmp_path / "out") == ["dir", "dir/a.txt", "dir/hard", "dir/link"]
    assert (tmp_path / "out" / "dir" / "link").read_text() == "alpha"


def test_a_3mb_archive_of_3gib_is_refused_by_ratio_after_reading_one_header(tmp_path: Path) -> None:
    bomb = zero_bomb(tmp_path / "bomb.tar.gz", 3 << 30)  # under the byte cap: only the ratio stops it
    size = bomb.stat().st_size
    assert size < 4 << 20
    with pytest.raises(ArchiveTooLargeError, match=rf"^refusing to extract bomb: more than {100 * size:,} bytes"):
        extract_tar_gz(bomb, tmp_path / "out", what="bomb")
    assert _tree(tmp_path / "out") == []


def test_the_ratio_applies_only_past_its_floor_and_the_byte_cap_always(tmp_path: Path) -> None:
    small = zero_bomb(tmp_path / "small.tar.gz", 8 << 20)  # ~1000:1, but 8 MiB is below any floor worth a refusal
    assert extract_tar_gz(small, tmp_path / "a", what="small", limits=ArchiveLimits(ratio_floor=16 << 20)) == 1
    assert (tmp_path / "a" / "zeros.bin").stat().st_size == 8 << 20
    with pytest.raises(ArchiveTooLargeError, match="more than 4,194,304 bytes unpacked"):
        extract_tar_gz(small, tmp_path / "b", what="small", limits=ArchiveLimits(ratio_floor=4 << 20))
    with pytest.raises(ArchiveTooLargeError, match="more than 1,048,576 bytes unpacked"):
        extract_tar_gz(small, tmp_path / "c", what="small", limits=ArchiveLimits(max_bytes=1 << 20))
    assert ARCHIVE_LIMITS.budget(5 << 20) == 500 << 20 and ARCHIVE_LIMITS.budget(1) == ARCHIVE_LIMITS.ratio_floor


def test_too_many_members_are_refused_before_any_is_written(tmp_path: Path) -> None:
    archive = tar_gz(tmp_path / "many.tar.gz", [member(f"f{i}", b"x") for i in range(50)])
    with pytest.raises(ArchiveTooLargeError, match="more than 10 members"):
        extract_tar_gz(archive, tmp_path / "out", what="many", limits=ArchiveLimits(max_entries=10))
    assert _tree(tmp_path / "out") == []


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        ([member("/etc/evil", b"x")], "has an absolute path"),
        ([member("a/../../evil", b"x")], "has a '..' path segment"),
        ([member("pipe", kind=tarfile.FIFOTYPE)], "is a device or FIFO"),
        ([member("dev", kind=tarfile.CHRTYPE)], "is a device or FIFO"),
        ([member("up", kind=tarfile.SYMTYPE, linkname="../../etc")], "is a link pointing outside"),
        ([member("abs", kind=tarfile.SYMTYPE, linkname="/etc/passwd")], "is a link to an absolute path"),
        ([member("h", kind=tarfile.LNKTYPE, linkname="/etc/shadow")], "is a hard link to '/etc/shadow'"),
        ([member("d", kind=tarfile.SYMTYPE, linkname="."), member("d/x", b"x")], "lies under a link or file"),
        ([member("a", b"1"), member("./a", b"2")], "appears twice"),
    ],
    ids=["absolute", "dotdot", "fifo", "device", "link-out", "link-abs", "hardlink-out", "under-link", "twice"],
)
def test_unsafe_members_are_refused_in_one_line(tmp_path: Path, members: list, reason: str) -> None:
    archive = tar_gz(tmp_path / "evil.tar.gz", members)
    with pytest.raises(UnsafeArchiveInputError, match=f"^refusing to extract evil: member .* {reason}") as refused:
        extract_tar_gz(archive, tmp_path / "out", what="evil")
    assert "\n" not in str(refused.value)
    assert _tree(tmp_path / "out") == []


def test_a_sparse_member_is_refused_while_its_header_is_read(tmp_path: Path) -> None:
    old_gnu = member("sparse", kind=tarfile.GNUTYPE_SPARSE)
    with pytest.raises(UnsafeArchiveInputError, match="'sparse' is a sparse file"):
        extract_tar_gz(tar_gz(tmp_path / "s0.tar.gz", [old_gnu], fmt=tarfile.GNU_FORMAT), tmp_path / "a", what="s")
    # GNU sparse 1.0 (pax): its map, one number a line, would be read into memory before the member is seen.
    pax = member("GNUSparseFile.0/big", b"999999999\n" * 10)
    pax[0].pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "big"}
    with pytest.raises(UnsafeArchiveInputError, match="is a sparse file"):
        extract_tar_gz(tar_gz(tmp_path / "s1.tar.gz", [pax]), tmp_path / "b", what="s")


def test_a_header_that_asks_for_megabytes_at_once_is_refused(tmp_path: Path) -> None:
    long_name = member("n" * (2 << 20), b"x")  # GNU stores it as a 2 MiB long-name record, read in one piece
    archive = tar_gz(tmp_path / "long.tar.gz", [long_name], fmt=tarfile.GNU_FORMAT)
    with pytest.raises(UnsafeArchiveInputError, match=r"a header asks for 2,09[\d,]+ bytes at once"):
        extract_tar_gz(archive, tmp_path / "out", what="long")
    too_long = member("n" * 5000, b"x")  # a name no file system takes
    archive = tar_gz(tmp_path / "name.tar.gz", [too_long])
    with pytest.raises(UnsafeArchiveInputError, match="longer than any file system takes"):
        extract_tar_gz(archive, tmp_path / "out2", what="name")


def test_not_a_tar_gz_and_a_full_disk_are_one_line_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "junk").write_bytes(b"just bytes")
    with pytest.raises(UnsafeArchiveInputError, match=r"^junk is not a valid tar\.gz archive"):
        extract_tar_gz(tmp_path / "junk", tmp_path / "out", what="junk")
    archive = tar_gz(tmp_path / "ok.tar.gz", [member("a.txt", b"alpha")])

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tarfile.TarFile, "makefile", full_disk)
    with pytest.raises(InfrastructureError, match=r"^ok: cannot extract into .*: No space left on device$"):
        extract_tar_gz(archive, tmp_path / "full", what="ok")
