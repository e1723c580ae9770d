"""Uploaded adapter archives: what is unpacked, and every way an archive is refused."""

from __future__ import annotations

import gzip
import io
import os
import stat
import struct
import tarfile
import zipfile

import pytest

from loraplex.gateway.domains.adapters.archive import (
    CHUNK,
    TAR_HEADER_BYTES,
    ArchiveError,
    UnpackMeter,
    detect_format,
    member_path,
    unpack_adapter,
)

CONFIG = b'{"peft_type": "LORA"}'
WEIGHTS = b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"__metadata__":{}}' + b"\x00" * 64
GOOD = {"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS}
LIMITS = dict(max_members=16, max_unpacked_bytes=1 << 20)


def make_zip(files: dict[str, bytes], *, modes: dict[str, int] | None = None) -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            if modes and name in modes:
                info.external_attr = modes[name] << 16
            z.writestr(info, data)
    buf.seek(0)
    return buf


def make_tar_gz(files: dict[str, bytes], extra=()) -> io.BytesIO:
    """``files`` as regular members; ``extra``: ready TarInfo objects (links, devices...)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        for info in extra:
            t.addfile(info)
    buf.seek(0)
    return buf


def unpack(buf, **limits):
    return unpack_adapter(buf, **{**LIMITS, **limits})


def refused(buf, match, **limits):
    with pytest.raises(ArchiveError, match=match):
        unpack(buf, **limits)


@pytest.mark.parametrize("maker", [make_zip, make_tar_gz], ids=["zip", "tar.gz"])
def test_unpacks_the_two_files_and_ignores_the_rest(maker):
    assert unpack(maker(GOOD)) == (CONFIG, WEIGHTS)
    noisy = {
        "./adapter_config.json": CONFIG,
        "./adapter_model.safetensors": WEIGHTS,
        "README.md": b"# model card written by save_pretrained",
        "__MACOSX/._adapter_config.json": b"\x00\x05\x16\x07",
        "docs/": b"",
    }
    assert unpack(maker(noisy)) == (CONFIG, WEIGHTS)


def test_tar_made_the_usual_way(tmp_path):
    """``tar czf a.tar.gz -C adapter .``: a ``./`` directory entry and ``./`` prefixes."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for name, data in GOOD.items():
        (adapter / name).write_bytes(data)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        t.add(adapter, arcname=".")
    assert [m.name for m in tarfile.open(fileobj=io.BytesIO(buf.getvalue()))][0] == "."
    assert unpack(buf) == (CONFIG, WEIGHTS)


def test_format_is_told_by_content():
    assert detect_format(make_zip(GOOD).read(4)) == "zip"
    assert detect_format(make_tar_gz(GOOD).read(4)) == "tar.gz"
    assert detect_format(b"PK\x05\x06") == "zip"  # an empty zip
    for junk in (b"", b"{}", b"\x7fELF", CONFIG, WEIGHTS):
        assert detect_format(junk) is None
        refused(io.BytesIO(junk), "neither a .zip nor a .tar.gz")


@pytest.mark.parametrize(
    "name, match",
    [
        ("../adapter_config.json", r"outside the archive \('\.\.'\)"),
        ("a/../../x", r"outside the archive"),
        ("..\\evil", r"outside the archive"),
        ("/etc/passwd", "absolute path"),
        ("\\\\server\\share", "absolute path"),
        ("C:\\windows\\x", "absolute path"),
        ("c:x", "absolute path"),
        ("a\x00b", "invalid name"),
        ("", "invalid name"),
    ],
)
def test_unsafe_names(name, match):
    with pytest.raises(ArchiveError, match=match):
        member_path(name)


def test_member_paths():
    assert member_path("adapter_config.json") == "adapter_config.json"
    assert member_path("./a//b/") == "a/b"
    assert member_path("./") is None and member_path(".") is None
    assert member_path("a..b/..c") == "a..b/..c"  # dots inside a name are fine


@pytest.mark.parametrize("maker", [make_zip, make_tar_gz], ids=["zip", "tar.gz"])
@pytest.mark.parametrize("bad", ["../x", "../adapter_config.json", "/abs/x", "sub/../../x"])
def test_zip_slip_anywhere_refuses_the_archive(maker, bad):
    refused(maker({**GOOD, bad: b"pwned"}), "outside the archive|absolute path")


def test_links_and_devices_in_tar():
    def info(name, kind, **kw):
        i = tarfile.TarInfo(name)
        i.type = kind
        for k, v in kw.items():
            setattr(i, k, v)
        return i

    cases = [
        (info("adapter_model.safetensors", tarfile.SYMTYPE, linkname="/etc/passwd"), "is a link"),
        (info("x", tarfile.SYMTYPE, linkname="adapter_config.json"), "is a link"),
        (info("h", tarfile.LNKTYPE, linkname="adapter_config.json"), "is a link"),
        (info("tty", tarfile.CHRTYPE, devmajor=4, devminor=1), "not a regular file"),
        (info("sda", tarfile.BLKTYPE, devmajor=8), "not a regular file"),
        (info("pipe", tarfile.FIFOTYPE), "not a regular file"),
    ]
    for member, match in cases:
        files = {k: v for k, v in GOOD.items() if k != member.name}
        refused(make_tar_gz(files, extra=[member]), match)


def test_symlink_and_device_in_zip():
    link = stat.S_IFLNK | 0o777
    refused(make_zip({**GOOD, "evil": b"/etc/passwd"}, modes={"evil": link}), "symbolic link")
    refused(
        make_zip(GOOD, modes={"adapter_config.json": link}),
        "symbolic link",
    )
    fifo = stat.S_IFIFO | 0o644
    refused(make_zip({**GOOD, "p": b""}, modes={"p": fifo}), "not a regular file")
    ok = make_zip(GOOD, modes={"adapter_config.json": stat.S_IFREG | 0o644})
    assert unpack(ok) == (CONFIG, WEIGHTS)


def test_encrypted_zip_entry():
    buf = make_zip(GOOD)
    data = bytearray(buf.getvalue())
    for sig, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # local and central headers
        pos = data.find(sig)
        while pos >= 0:
            data[pos + flag_at] |= 0x1
            pos = data.find(sig, pos + 4)
    refused(io.BytesIO(bytes(data)), "encrypted")


@pytest.mark.parametrize("maker", [make_zip, make_tar_gz], ids=["zip", "tar.gz"])
def test_too_many_members(maker):
    many = {**GOOD, **{f"junk/{i}.txt": b"x" for i in range(20)}}
    refused(maker(many), "more than 16 entries")
    assert unpack(maker(many), max_members=22) == (CONFIG, WEIGHTS)


def test_zip_directory_is_checked_before_it_is_parsed():
    """An end record announcing 70k entries is refused without building 70k ZipInfos."""
    buf = make_zip(GOOD)
    data = bytearray(buf.getvalue())
    eocd = data.rfind(b"PK\x05\x06")
    struct.pack_into("<HH", data, eocd + 8, 0xFFF0, 0xFFF0)
    refused(io.BytesIO(bytes(data)), "more than 16 entries")
    struct.pack_into("<HHI", data, eocd + 8, 2, 2, 10**8)  # a huge central directory
    refused(io.BytesIO(bytes(data)), "more than 16 entries")


def test_zip_bomb_stops_at_the_cap():
    """A 1000:1 deflate bomb: 16 MiB of zeros in ~16 KiB; the cap is 1 MiB."""
    bomb = make_zip({"adapter_config.json": CONFIG, "adapter_model.safetensors": bytes(16 << 20)})
    assert len(bomb.getvalue()) < 200_000
    refused(bomb, r"unpacks to more than 1048576 bytes")


def test_tar_gz_bomb_stops_at_the_cap_even_in_skipped_members():
    bomb = make_tar_gz({**GOOD, "README.md": bytes(16 << 20)})
    assert len(bomb.getvalue()) < 200_000
    refused(bomb, "unpacks to more than")
    huge_member = make_tar_gz({"adapter_config.json": CONFIG, "x": bytes(2 << 20)})
    refused(huge_member, "unpacks to more than")


def test_tar_gz_stream_is_capped_below_the_headers():
    """A 16 MiB PAX header (tarfile reads one whole into memory) is stopped after 1 MiB."""
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type = tarfile.XHDTYPE
    pax.size = 16 << 20
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        t.addfile(pax, io.BytesIO(bytes(pax.size)))
        for name, data in GOOD.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    assert len(buf.getvalue()) < 200_000
    buf.seek(0)
    meter = UnpackMeter()
    refused(
        buf,
        "tar header block .* larger than 1048576 bytes",
        max_unpacked_bytes=64 << 20,
        meter=meter,
    )
    assert meter.produced <= TAR_HEADER_BYTES + 2 * CHUNK
    # a bare gzip of zeros is an empty tar: it stops at the first (zero) header block
    refused(io.BytesIO(gzip.compress(bytes(8 << 20))), "no adapter_config.json")


def test_zip_header_lying_about_sizes():
    """An entry whose declared size is small but whose data inflates further: CRC/size check."""
    buf = make_zip({"adapter_config.json": CONFIG, "adapter_model.safetensors": bytes(4096)})
    data = bytearray(buf.getvalue())
    for sig, size_at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        pos = data.find(sig)
        while pos >= 0:
            (size,) = struct.unpack_from("<I", data, pos + size_at)
            if size == 4096:
                struct.pack_into("<I", data, pos + size_at, 10)
            pos = data.find(sig, pos + 4)
    refused(io.BytesIO(bytes(data)), "corrupt")


@pytest.mark.parametrize("maker", [make_zip, make_tar_gz], ids=["zip", "tar.gz"])
def test_corrupt_archives(maker):
    good = maker(GOOD).getvalue()
    refused(io.BytesIO(good[: len(good) // 2]), "corrupt|truncated|no adapter")
    flipped = bytearray(good)
    for i in range(len(good) // 3, len(good) // 3 + 8):
        flipped[i] ^= 0xFF
    refused(io.BytesIO(bytes(flipped)), "corrupt|truncated|no adapter")


def test_gzip_that_is_not_a_tar():
    refused(io.BytesIO(gzip.compress(b"just some json {}" * 50)), "corrupt")


@pytest.mark.parametrize("maker", [make_zip, make_tar_gz], ids=["zip", "tar.gz"])
def test_missing_nested_pickle_and_duplicate(maker):
    refused(maker({"adapter_config.json": CONFIG}), "no adapter_model.safetensors at its root")
    refused(maker({"adapter_model.safetensors": WEIGHTS}), "no adapter_config.json")
    nested = {f"my-adapter/{k}": v for k, v in GOOD.items()}
    refused(maker(nested), "must be at the archive's root, found my-adapter/adapter_config")
    pickle = {"adapter_config.json": CONFIG, "adapter_model.bin": b"\x80\x02}q\x00."}
    refused(maker(pickle), "adapter_model.bin are a pickle file")
    refused(maker({}), "no adapter_config.json")


def test_duplicate_entries():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("adapter_config.json", CONFIG)
        z.writestr("adapter_model.safetensors", WEIGHTS)
        z.writestr("./adapter_config.json", b"{}")
    refused(buf, "holds adapter_config.json twice")
    tar = make_tar_gz(GOOD, extra=[])
    data = make_tar_gz({**GOOD, "./adapter_model.safetensors": b"other"})
    assert unpack(tar) == (CONFIG, WEIGHTS)
    refused(data, "holds adapter_model.safetensors twice")


def test_reads_from_a_spooled_file_on_disk(tmp_path):
    """The upload's SpooledTemporaryFile rolled to disk works as well as memory."""
    path = tmp_path / "a.zip"
    path.write_bytes(make_zip({**GOOD, "pad": os.urandom(1 << 16)}).getvalue())
    with open(path, "rb") as f:
        f.seek(123)  # wherever the caller left it
        assert unpack(f) == (CONFIG, WEIGHTS)


# ------------------------------------------------------- bounded memory while inflating
def _traced_peak(fn) -> int:
    """Peak bytes Python allocated while ``fn`` ran (tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


CAPS = {"adapter_config.json": 64 * 1024, "adapter_model.safetensors": 1 << 20}


@pytest.mark.parametrize("maker", [make_zip, make_tar_gz], ids=["zip", "tar.gz"])
def test_bomb_member_stops_at_its_own_cap_holding_one_chunk(maker):
    """64 MiB of zeros as the weights (~64 KiB compressed), a 1 MiB cap for them, 1 GiB in all:
    the refusal comes within a chunk of the member's cap and never holds the member."""
    bomb = maker({"adapter_config.json": CONFIG, "adapter_model.safetensors": bytes(64 << 20)})
    meter = UnpackMeter()

    def run():
        with pytest.raises(ArchiveError, match="unpacks to more than 1048576 bytes, more than"):
            unpack_adapter(
                bomb, max_members=16, max_unpacked_bytes=1 << 30, member_caps=CAPS, meter=meter
            )

    peak = _traced_peak(run)
    assert meter.produced <= (1 << 20) + CHUNK + 64 * 1024
    assert meter.largest_read <= CHUNK
    assert peak < 4 * CHUNK


def test_zip_member_declaring_more_than_its_cap_is_refused_unread():
    big = make_zip({"adapter_config.json": CONFIG, "adapter_model.safetensors": bytes(2 << 20)})
    meter = UnpackMeter()
    with pytest.raises(ArchiveError, match="more than a valid adapter_model.safetensors"):
        unpack_adapter(
            big, max_members=16, max_unpacked_bytes=1 << 30, member_caps=CAPS, meter=meter
        )
    assert meter.produced <= len(CONFIG)


def test_tar_member_over_its_cap_is_refused_before_its_data():
    big = make_tar_gz({**GOOD, "adapter_config.json": bytes(1 << 20)})
    meter = UnpackMeter()
    with pytest.raises(ArchiveError, match="adapter_config.json in the archive unpacks to more"):
        unpack_adapter(
            big, max_members=16, max_unpacked_bytes=1 << 30, member_caps=CAPS, meter=meter
        )
    assert meter.produced <= 64 * 1024


def test_many_member_tar_gz_bomb_is_bounded_by_the_total_cap():
    """1,000 junk members of 1 MiB of zeros each: stops at the member count, never inflating
    more than the members seen so far."""
    files = {f"junk/{i}": bytes(1 << 20) for i in range(40)}
    bomb = make_tar_gz({**GOOD, **files})
    meter = UnpackMeter()
    with pytest.raises(ArchiveError, match="more than 16 entries|unpacks to more than"):
        unpack_adapter(bomb, max_members=16, max_unpacked_bytes=4 << 20, meter=meter)
    assert meter.produced <= (4 << 20) + 17 * 64 * 1024 + CHUNK


def test_accepted_member_is_held_once():
    """An accepted 2 MiB weights member costs about its own size, not twice (no join)."""
    weights = os.urandom(2 << 20)
    archive = make_zip({"adapter_config.json": CONFIG, "adapter_model.safetensors": weights})
    out = {}

    def run():
        out["files"] = unpack(archive, max_unpacked_bytes=8 << 20)

    peak = _traced_peak(run)
    assert out["files"] == (CONFIG, weights)
    assert peak < len(weights) + 4 * CHUNK
