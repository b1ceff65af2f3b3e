"""The layers of docs/architecture.md, checked from the source: what each package may import,
that nothing outside the engine reaches into it, and the public names of ``s3ckpt``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import s3ckpt

PACKAGE = Path(s3ckpt.__file__).parent
FOUNDATION = {"s3ckpt.config", "s3ckpt.errors", "s3ckpt.crc32c", "s3ckpt.scatter"}
# What each layer may import from s3ckpt, besides itself and the foundation.
ALLOWED = {
    "foundation": set(),
    "engine": set(),
    "format": set(),
    "dcp": {"engine", "format"},
    "tools": {"engine", "format", "dcp", "top"},  # top: the public names (the demo uses them)
    "manager": {"engine", "format", "dcp", "tools"},
    "cli": {"format", "tools", "top"},  # bytes move through tools: the CLI only parses and prints
    "top": {
        "dcp",
        "tools",
        "manager",
        "cli",
    },  # s3ckpt/__init__.py (the public names) and __main__.py
    "testing": set(),  # the fault proxy: stands alone
}
# The engine's insides: the parts' handle on the store's calls, the aiobotocore client, reads
# and uploads at the request level.
ENGINE_PRIVATE = {"_calls", "_client", "_get_range", "_create_upload", "_abort_quietly"}
# The engine's doors (docs/architecture.md): the contract, the loop bridge, the store resolver
# and the in-memory store. Nothing above the engine imports any other module of it.
ENGINE_DOORS = {
    "s3ckpt.engine.contract",
    "s3ckpt.engine.bridge",
    "s3ckpt.engine.store",
    "s3ckpt.engine.memory",
}
# The format is pure (no I/O); these of its modules turn tensors into bytes and DCP's types
# into records, so they import torch. The others must not: the light commands never load it.
FORMAT_WITH_TORCH = {
    "s3ckpt.format.tensorbytes",
    "s3ckpt.format.digests",
    "s3ckpt.format.packing",
    "s3ckpt.format.record.encoder",
    "s3ckpt.format.record.torchmeta",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    if module in FOUNDATION:
        return "foundation"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else "top"


def imports(path: Path) -> list[tuple[str, ast.AST]]:
    """Absolute names of the s3ckpt modules (or module attributes) ``path`` imports."""
    module, tree = module_name(path), ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base == "s3ckpt" or base.startswith("s3ckpt."):
                found += [(f"{base}.{alias.name}", node) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node) for a in node.names if a.name.startswith("s3ckpt")]
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_a_module_imports_only_from_the_layers_below_it(path: Path) -> None:
    own = layer(module_name(path))
    for name, node in imports(path):
        # `from s3ckpt.errors import X` names s3ckpt.errors.X: its module decides.
        module = name.rpartition(".")[0] if name.rpartition(".")[0] in FOUNDATION else name
        target = layer(module)
        if target in ("foundation", own):
            continue
        assert target in ALLOWED[own], (
            f"{module_name(path)} (layer {own}) imports {name} (layer {target}) at line "
            f"{getattr(node, 'lineno', '?')}"
        )


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if layer(module_name(p)) != "engine"], ids=module_name
)
def test_nothing_outside_the_engine_reaches_into_it(path: Path) -> None:
    tree = ast.parse(path.read_text())
    private = [
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_PRIVATE
    ]
    private += [
        name.rpartition(".")[2]
        for name, _ in imports(path)
        if ".engine." in name and name.rpartition(".")[2].startswith("_")
    ]
    assert not private, f"{module_name(path)} uses the engine's private {sorted(set(private))}"


def module_of(name: str) -> str:
    """The module an imported name lives in: ``s3ckpt.engine.store.get_store`` is
    ``s3ckpt.engine.store``."""
    parts = name.split(".")
    while len(parts) > 1:
        base = PACKAGE.parent.joinpath(*parts)
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            break
        parts.pop()
    return ".".join(parts)


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if layer(module_name(p)) != "engine"], ids=module_name
)
def test_the_engine_is_entered_only_by_its_doors(path: Path) -> None:
    entered = {
        (module_of(name), getattr(node, "lineno", 0))
        for name, node in imports(path)
        if module_of(name).startswith("s3ckpt.engine.") or module_of(name) == "s3ckpt.engine"
    }
    stray = sorted((m, line) for m, line in entered if m not in ENGINE_DOORS)
    assert not stray, f"{module_name(path)} imports engine modules that are not doors: {stray}"


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if layer(module_name(p)) == "format"], ids=module_name
)
def test_only_the_documented_format_modules_import_torch(path: Path) -> None:
    tree = ast.parse(path.read_text())
    top_level = [
        node
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(
            (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
            == "torch"
            for alias in node.names
        )
    ]
    if module_name(path) not in FORMAT_WITH_TORCH:
        assert not top_level, f"{module_name(path)} imports torch at its top"


def test_the_layers_are_as_documented() -> None:
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} == {
        "cli",
        "dcp",
        "engine",
        "format",
        "manager",
        "testing",
        "tools",
    }
    for package in ("engine", "format", "dcp", "tools", "manager", "testing"):
        docstring = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
        assert docstring and "import" in docstring, f"s3ckpt.{package} says what it may import"


def test_the_public_names_of_s3ckpt() -> None:
    assert s3ckpt.__all__ == [
        "AccessDenied",
        "BucketNotFound",
        "CheckpointError",
        "CheckpointExists",
        "CheckpointManager",
        "CheckpointNotFound",
        "CheckpointReplaced",
        "ChecksumMismatch",
        "CommitOutcomeUnknown",
        "ConfigError",
        "EndpointUnreachable",
        "IncompleteCheckpoint",
        "MetadataError",
        "ObjectNotFound",
        "PreconditionFailed",
        "Retention",
        "S3CkptError",
        "S3Config",
        "S3Reader",
        "S3Writer",
        "SafetensorsReader",
        "SavePolicy",
        "StateDictMismatch",
        "StorageError",
        "UnsafeCheckpoint",
        "WriteOptions",
        "export_safetensors",
    ]
    for name in s3ckpt.__all__:
        assert getattr(s3ckpt, name).__module__.startswith("s3ckpt."), name
    from s3ckpt import S3Config, S3Reader, S3Writer  # the README's import

    assert S3Writer.__module__ == "s3ckpt.dcp.writer" and S3Reader and S3Config
