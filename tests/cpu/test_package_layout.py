"""The package's import structure (docs/DESIGN.md, "Layout by execution path"), read from the
source: no import circle among its modules, imports inside functions included; the math leaf
imports nothing of the package; the ops import nothing of Megatron or of the integration, which
imports the ops by their public names only, but for the scalar checks that ``FusedLMConfig`` shares
with the ops (``ops.options``: a setting is refused by the same function either way)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_fused_lm"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
# The integration's imports of the ops' private modules, each with the reason it is allowed.
PRIVATE_OPS_IMPORTS = {
    "megatron_fused_lm.integration.config": {"megatron_fused_lm.ops.options"},  # the ops' own setting checks
}


def imports_of(path: Path) -> set:
    """Every module a file imports, at any depth of its code, as absolute dotted names: for
    ``from X import y``, the module ``X.y`` where ``y`` is one, else ``X``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module)
    return found


def graph() -> dict:
    return {
        name: {target for target in imports_of(path) if target in MODULES and target != name}
        for name, path in MODULES.items()
    }


def test_no_import_circle():
    edges = graph()
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                raise AssertionError("import circle: " + " -> ".join([*trail, node, target]))
            if target not in state:
                visit(target, [*trail, node])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


def test_the_math_leaf_and_the_layers():
    edges = {name: imports_of(path) for name, path in MODULES.items()}
    assert not {target for target in edges["megatron_fused_lm.ops.softmax"] if target.startswith("megatron_fused_lm")}
    for name, targets in edges.items():
        if name.startswith("megatron_fused_lm.ops"):
            assert not any(target.startswith(("megatron.", "megatron_fused_lm.integration")) for target in targets), (
                name
            )
        if name.startswith("megatron_fused_lm.integration"):
            private = {target for target in targets if target.startswith("megatron_fused_lm.ops.")}
            assert private == PRIVATE_OPS_IMPORTS.get(name, set()), (name, private)


def test_the_torch_backend_reaches_no_triton_kernel():
    # backend="torch" must isolate a kernel bug: nothing it runs may import kernels/, directly or
    # through a module it imports (the backends package itself imports the Triton ones lazily).
    edges = graph()
    torch_backend = ["megatron_fused_lm.ops.backends.torch_loss", "megatron_fused_lm.ops.backends.torch_recompute"]
    reached, stack = set(), list(torch_backend)
    while stack:
        for target in edges[stack.pop()] - reached:
            reached.add(target)
            stack.append(target)
    assert not {name for name in reached if name.startswith("megatron_fused_lm.ops.kernels")}, sorted(reached)
    assert "megatron_fused_lm.ops.backends.contract" in reached  # the walk does follow the shared steps


def test_the_integration_names_are_the_package_names():
    """``from megatron_fused_lm import X`` gives the integration's X for every name it exports (the
    package imports the integration on first use: the ops run without megatron-core,
    test_without_megatron)."""
    import megatron_fused_lm
    from megatron_fused_lm import integration

    assert set(integration.__all__) <= set(megatron_fused_lm.__all__)
    for name in integration.__all__:
        assert getattr(megatron_fused_lm, name) is getattr(integration, name), name


def test_only_the_cute_backend_reaches_the_cute_kernels():
    # The CuTe kernels need the optional cute extra: the other backends must run without it (the
    # backends package reaches every backend, lazily, by design).
    edges = graph()
    for start in ("megatron_fused_lm.ops.backends.triton", "megatron_fused_lm.ops.backends.torch_loss",
                  "megatron_fused_lm.ops.backends.torch_recompute"):  # fmt: skip
        reached, stack = set(), [start]
        while stack:
            for target in edges[stack.pop()] - reached:
                reached.add(target)
                stack.append(target)
        assert not {name for name in reached if name.startswith("megatron_fused_lm.ops.cute_kernels")}, (start, reached)
    assert "megatron_fused_lm.ops.cute_kernels.statistics_kernel" in edges["megatron_fused_lm.ops.backends.cute"]
