"""Package-level promises: cheap import, the error hierarchy, the native copy path and xxh3 checksums."""

import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvplugins import errors, native


def test_import_is_cheap_and_torch_free():
    code = (
        "import sys,time; t=time.perf_counter(); import kvplugins; dt=time.perf_counter()-t; "
        "print(dt, 'torch' in sys.modules, 'zmq' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) <= 0.3
    assert out[1:] == ["False", "False"]


def test_every_error_derives_from_the_base():
    names = [
        n for n in dir(errors) if isinstance(getattr(errors, n), type) and issubclass(getattr(errors, n), Exception)
    ]
    assert len(names) > 10
    assert all(issubclass(getattr(errors, n), errors.KVPluginsError) for n in names)


def test_master_unreachable_names_address_and_timeout():
    e = errors.MasterUnreachable("127.0.0.1:5555", 250)
    assert "127.0.0.1:5555" in str(e) and "250 ms" in str(e)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n, size", [(1, 1), (3, 4099), (64, 300_000)])
def test_native_copy_batch_is_exact(threads, n, size):
    rng = np.random.default_rng(n * size)
    src = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    dst = [np.zeros(size, np.uint8) for _ in range(n)]
    native.copy_batch([d.ctypes.data for d in dst], [s.ctypes.data for s in src], [size] * n, threads=threads)
    assert all(np.array_equal(d, s) for d, s in zip(dst, src))


def test_native_copy_batch_rejects_ragged_input():
    with pytest.raises(errors.NativeError, match="differ in length"):
        native.copy_batch([1, 2], [1], [1, 1])


@pytest.mark.parametrize("isa", native.hash_tiers())
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("sizes", [[0], [1, 65535, 65536, 65537], [300_000] * 20, [4096] * 128])
def test_fused_copy_digests_equal_xxhash_on_every_tier(isa, threads, sizes):
    rng = np.random.default_rng(sum(sizes))
    src = [rng.integers(0, 256, n + 3, dtype=np.uint8)[3:] for n in sizes]  # misaligned starts
    dst = [np.zeros(n + 5, np.uint8)[5:] for n in sizes]
    got = np.zeros(len(sizes), dtype=np.uint64)
    native.copy_batch([d.ctypes.data for d in dst], [s.ctypes.data for s in src], sizes, threads, got, isa)
    assert all(np.array_equal(d, s) for d, s in zip(dst, src))
    assert got.tolist() == [xxhash.xxh3_64_intdigest(s) for s in src]


@pytest.mark.parametrize("isa", native.hash_tiers())
def test_hash_keys_streams_a_key_over_its_spans(isa):
    data = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    a = data.ctypes.data
    spans = [(a + 7, 100_000), (a + 200_000, 3), (a + 300_000, 70_000), (a + 500_000, 1)]  # key 0: 3, key 2: 1
    got = native.hash_keys([s[0] for s in spans], [s[1] for s in spans], [0, 0, 0, 2], 3, threads=2, isa=isa)
    want0 = xxhash.xxh3_64_intdigest(
        data[7:100_007].tobytes() + data[200_000:200_003].tobytes() + data[300_000:370_000].tobytes()
    )
    assert got.tolist() == [want0, xxhash.xxh3_64_intdigest(b""), xxhash.xxh3_64_intdigest(data[500_000:500_001])]


def test_hash_keys_rejects_bad_owners_and_tiers():
    with pytest.raises(errors.NativeError, match="not consecutive"):
        native.hash_keys([1, 2, 3], [0, 0, 0], [0, 1, 0], 2)
    with pytest.raises(errors.NativeError, match="owner is >="):
        native.hash_keys([1], [0], [5], 2)
    with pytest.raises(errors.NativeError, match="'neon' is not supported here; use auto or one of"):
        native.copy_batch([1], [1], [0], 1, np.zeros(1, dtype=np.uint64), "neon")
    with pytest.raises(errors.NativeError, match="one per span"):
        native.copy_batch([1], [1], [0], 1, np.zeros(2, dtype=np.uint64))


def test_the_readme_layout_names_every_folder():
    """README's Layout paragraph matches the tree: every package under kvplugins/ and every top-level folder in
    git is named there (issue #31)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    layout = text[text.index("## Layout") :]
    packages = {p.parent.name for p in (root / "kvplugins").glob("*/__init__.py")}
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    top = {line.split("/")[0] for line in tracked.splitlines() if "/" in line and not line.startswith(".")}
    missing = sorted(f"{name}/" for name in packages | top if f"`{name}/`" not in layout)
    assert not missing, f"README Layout does not name {missing}"


NATIVE = {
    "kvplugins._native",
    "kvplugins._moe",
    "kvplugins._meta",
    "kvplugins._tcp",
    "kvplugins._verbs",
}  # raw nanobind modules
PRIVATE_OK = {"_replace", "_asdict", "_fields", "_exit", "_getframe", "_make", "_actions"}  # stdlib's own API


def _private_uses(path) -> list[str]:
    """``obj._name`` where ``obj`` is not self/cls and the file defines no ``_name`` (so it belongs to another
    module), and ``from kvplugins.x import _name``; raw native modules are imported only by their wrappers."""
    import ast

    tree = ast.parse(path.read_text())
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvplugins"):
            out += [
                f"{node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__") and f"{node.module}.{a.name}" not in NATIVE
            ]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in PRIVATE_OK
            and node.attr not in own
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def test_no_module_uses_another_modules_private_names():
    """Issue #33: collaborators go through designed public operations (e.g. MasterService.place/evict/drop for
    its parts, RpcServer.release/send_control for the reply policy, StoreClient.put_start/locate/
    transfer_ranges for Mooncake's sessions), never another module's ``_private`` names."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "kvplugins"
    found = {str(p.relative_to(root)): uses for p in sorted(root.rglob("*.py")) if (uses := _private_uses(p))}
    assert not found, f"private names of other modules used: {found}"


def test_ruff_finds_nothing():
    """The lint CI runs (pyproject's [tool.ruff.lint]): pyflakes and syntax errors over the code, tests and
    benchmarks. ruff comes with the test extra."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "kvplugins", "tests", "benchmarks"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_format_leaves_code_unchanged():
    """The format CI checks (pyproject's [tool.ruff], 120 columns): `ruff format --check` over the code, tests and
    benchmarks. Fix: run `.venv/bin/ruff format kvplugins tests benchmarks`."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "kvplugins", "tests", "benchmarks"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_strict_modules_type_check():
    """mypy --strict over pyproject's [tool.mypy] files (wire schemas and replies, transfer API, the vLLM connector,
    the SGLang HiCache backend, the Mooncake API class): no error, no explicit Any (disallow_any_explicit) and no
    `type: ignore` in them. mypy comes with the test extra."""
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    sources = [p for f in files for p in ([root / f] if f.endswith(".py") else sorted((root / f).rglob("*.py")))]
    assert sources and not [p for p in sources if "type: ignore" in p.read_text()]
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", "/dev/null"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "Success" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]


def test_every_module_is_named_in_the_architecture_map():
    """docs/architecture.md is the map (issue #33): every module under kvplugins/ appears there, by its path under
    kvplugins/ or by its file name in backticks (in its room's row or in "The rest of each room")."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "architecture.md").read_text()
    missing = [
        str(p.relative_to(root / "kvplugins"))
        for p in sorted((root / "kvplugins").rglob("*.py"))
        if p.name != "__init__.py" and str(p.relative_to(root / "kvplugins")) not in doc and f"`{p.name}`" not in doc
    ]
    assert not missing, f"docs/architecture.md names nowhere: {missing}"
