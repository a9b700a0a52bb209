"""What every training role's worker does with its model: build the layout and the engine with its initial weights,
and keep the parts its options offload in host memory between calls (actor, reference and critic share the code)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from shardrl.controller.rank_env import collective_timeout
from shardrl.data.batch import Batch
from shardrl.job.options import ModelOptions
from shardrl.models.checkpoint import load_model_from_dist
from shardrl.models.config import ModelConfig
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.offload import offload, on_device
from shardrl.workers.engine import ModelEngine


def create_layout(spec: LayoutSpec, ranks: list[int], registry: GroupRegistry | None) -> Layout:
    """A role's layout over its ranks, its groups taken from the process's registry (shared by colocated roles)."""
    return Layout.create(spec, ranks, timeout=collective_timeout(), registry=registry)


def build_engine(options: ModelOptions, hf_path: str, registry: GroupRegistry | None,
                 optional_weights: Sequence[str] = ()) -> ModelEngine:
    """A role's engine with its initial weights: from `options.dist_checkpoint` (converted with `python -m
    shardrl.models.convert hf-to-dist`), else from the HF checkpoint at `hf_path`, or none (random init) when the
    options say `load_weight=false`; then offloaded as the options ask. `model.override_config` applies to the
    model's config.json either way."""
    model_config = ModelConfig.from_pretrained(hf_path, overrides=options.override_config)
    layout = create_layout(options.spec, options.ranks, registry)
    if options.dist_checkpoint is not None:
        path = options.dist_checkpoint
        engine = ModelEngine(model_config, layout, options.engine, weights_loader=lambda chunks: load_model_from_dist(
            chunks, layout, path, optional_weights))
    else:
        engine = ModelEngine(model_config, layout, options.engine, hf_path=hf_path if options.load_weight else None,
                             optional_weights=optional_weights)
    if options.offload.any:
        offload(engine.chunks, engine.host_buffers, engine.optimizer, **_flags(options))
    return engine


def _flags(options: ModelOptions) -> dict[str, bool]:
    o = options.offload
    return dict(params=o.params, grads=o.grads, optimizer_state=o.optimizer_state)


@contextmanager
def resident(engine: ModelEngine, options: ModelOptions) -> Iterator[None]:
    """The engine's offloaded parts on the device for the body, back in host memory after it."""
    if not options.offload.any:
        yield
        return
    with on_device(engine.chunks, engine.host_buffers, engine.optimizer, **_flags(options)):
        yield


def unpadded_rows(batch: Batch) -> Batch:
    """Drop the controller's DP padding rows (copies of real samples) before anything that counts samples."""
    return batch.unpad() if batch.meta.get("num_pad") else batch
