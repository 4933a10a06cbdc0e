"""writeback's recipes for optimum-executorch.

``register()`` adds ``writeback-xnnpack`` to optimum-executorch's recipe registry (optimum-cli
calls it at start through ``optimum.commands.register``). The recipe lowers the program
optimum exports (with ``--use_custom_sdpa`` and friends as given) through ExecuTorch's
``to_edge_transform_and_lower`` with :func:`writeback_core.to_edge_arguments` for
``xnnpack`` (delegates preprocessing under
:func:`writeback_core.lowering.preprocess_shares_constants`, as the lowering path's own
partition step does) and writeback's one :func:`writeback_core.lowering.to_executorch`: the
caches are written in place, and optimum's runner metadata is kept.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RECIPES", "export_with_writeback_xnnpack", "register"]

# The backend the recipe partitions for, and whose program passes run.
_BACKEND = "xnnpack"


def export_with_writeback_xnnpack(model: Any, **kwargs: Any) -> dict[str, Any]:
    """The ``writeback-xnnpack`` recipe: ``model`` is optimum's exportable module; returns
    ``{"model": ExecutorchProgramManager}`` as optimum's own recipes do."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from writeback_core import to_edge_arguments
    from writeback_core.lowering import preprocess_shares_constants, to_executorch

    programs = model.export()
    if len(programs) == 1:
        programs = {"forward": next(iter(programs.values()))}
    arguments = to_edge_arguments(_BACKEND)
    # optimum's own pass (an embedding's padding_idx dropped), then writeback's.
    from optimum.executorch.passes.remove_padding_idx_embedding_pass import (  # type: ignore[import-not-found]  # optimum-executorch is installed beside this package, untyped
        RemovePaddingIdxEmbeddingPass,
    )

    arguments["transform_passes"] = [RemovePaddingIdxEmbeddingPass(), *(arguments["transform_passes"] or [])]
    with preprocess_shares_constants():
        edge = to_edge_transform_and_lower(
            programs,
            **arguments,
            compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
            constant_methods=model.metadata,
        )
    return {"model": to_executorch(edge, backend=_BACKEND)}


RECIPES = {"writeback-xnnpack": export_with_writeback_xnnpack}


def register() -> None:
    """Add every writeback recipe to optimum-executorch's registry (idempotent)."""
    from optimum.exporters.executorch.recipe_registry import (  # type: ignore[import-not-found]  # optimum-executorch is installed beside this package, untyped
        register_recipe,
    )

    for name, recipe in RECIPES.items():
        register_recipe(name)(recipe)
