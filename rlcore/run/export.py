"""`rlcore export`: a run's newest model as a Hugging Face checkpoint that transformers loads."""

from __future__ import annotations

from pathlib import Path

from rlcore.config import load_config
from rlcore.config.options import EMBEDDED_MODEL_PATHS
from rlcore.models.hf_checkpoint import load_model, resolve_dtype, save_model
from rlcore.models.lora import load_adapter, merge_lora, read_adapter_config
from rlcore.models.transformer import Transformer
from rlcore.parallel import fsdp
from rlcore.run.checkpoints import TOKENIZER_FILES, latest_checkpoint
from rlcore.run.rundir import RunDir
from rlcore.run.setup import add_adapters, embedded_model_dir
from rlcore.run.state import has_state


def export(source: Path, out: Path) -> Path:
    """Write the model of a run's newest checkpoint (or of `source` itself, when it is a checkpoint)
    to `out` as a Hugging Face checkpoint that transformers loads, with its tokenizer files: a LoRA
    run's base with the adapters merged in (W + scale * B @ A), in the base's dtype."""
    checkpoint = source if has_state(source) else latest_checkpoint(source)
    if (checkpoint / "model").is_dir():
        model, files = load_model(checkpoint / "model", "auto"), checkpoint / "model"
    elif (checkpoint / fsdp.SHARDS).is_dir():
        model, files = sharded_model(checkpoint)
    else:
        adapter = checkpoint / "adapter"
        base = Path(read_adapter_config(adapter).get("base_model_name_or_path") or "")
        model, files = load_model(base, "auto"), adapter
        load_adapter(model, adapter)
        merge_lora(model)
    extra = {name: files / name for name in TOKENIZER_FILES if (files / name).is_file()}
    return save_model(model, out, extra_files=extra)


def sharded_model(checkpoint: Path) -> tuple[Transformer, Path]:
    """A train.fsdp checkpoint's policy in this one process, and the directory of its tokenizer
    files: the run's model.path (its config.toml's), with LoRA's adapters merged in when the run
    trained some, and the trained weights loaded from the checkpoint's shards (DCP gathers them)."""
    run_dir = RunDir(checkpoint.parent)
    cfg = load_config(str(run_dir.config_toml), world_size=run_dir.recorded_ranks())  # its batch geometry's
    base = Path(cfg.model.path) if cfg.model.path not in EMBEDDED_MODEL_PATHS else embedded_model_dir(cfg)
    model = load_model(base, resolve_dtype(cfg.model.dtype, base))  # the dtype the run trained in
    if cfg.lora.enabled:
        add_adapters(model, cfg.lora, None)
    fsdp.load_weights(checkpoint / fsdp.SHARDS, model)
    merge_lora(model)
    return model, base
