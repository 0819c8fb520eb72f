"""LoRA adapters on a loaded Transformer, stored in PEFT's format.

`apply_lora` wraps chosen projections (q_proj ... down_proj) in `LoraLinear`, a frozen base plus a
trainable low-rank update, and freezes everything else: the optimizer sees `lora_parameters(model)`.
Adapters are `adapter_model.safetensors` + `adapter_config.json` as PEFT writes them, so PEFT loads
rlcore's and rlcore loads PEFT's; `merge_lora` folds them into the weights for export. The KL
reference is the run's starting point, computed by the same model inside `reference_adapters`: no
adapter (the base), or the starting adapter that `keep_as_reference` kept.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from rlcore.config.options import LORA_TARGETS
from rlcore.models.hf_checkpoint import CheckpointError, fsync_dir, listed, open_weights, read_json
from rlcore.models.transformer import Transformer

TARGETS = LORA_TARGETS  # the projections adapters can go on
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's key prefix: PeftModel.base_model (LoraModel).model (the CausalLM)

# adapter_config.json fields of a plain LoRA adapter, as PEFT writes them; a value other than
# these (or than null / false / {} / []) asks for something LoraLinear does not compute
PLAIN = {"bias": "none", "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None,
         "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None}
# newer PEFT options and LoRA variants, off (null / false) in a plain adapter; checked, not written
NEWER_OPTIONS = ("lora_bias", "exclude_modules", "layer_replication", "trainable_token_indices",
                 "target_parameters", "use_qalora", "alora_invocation_tokens", "use_bdlora", "arrow_config",
                 "velora_config", "monteclora_config", "kasa_config")


def lora_scaling(r: int, alpha: float, use_rslora: bool) -> float:
    """LoRA's alpha / r, or rsLoRA's alpha / sqrt(r)."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update (LoRA: Hu et al. 2021, arXiv:2106.09685):

        h = W x + b + scaling * B A dropout(x),   A [r, in], B [out, r]
        scaling = alpha / r, or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023, arXiv:2312.03732),

    whose factor keeps learning stable as r grows. A starts kaiming-uniform (a = sqrt(5), as PEFT
    inits lora_A) and B at zero, so at init the layer equals the base. A and B are fp32 whatever the
    base dtype: x is cast to fp32 for the adapter path and the sum back to the base output's dtype,
    as PEFT computes with autocast off.

    `mode` "train" computes with (A, B); "reference" with the frozen starting adapter `reference`
    (None: the base alone) and never with dropout, since the KL reference is deterministic.
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False):
        super().__init__()
        self.base = base.requires_grad_(False)
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = lora_scaling(r, alpha, use_rslora)
        self.config = {"r": r, "lora_alpha": alpha, "lora_dropout": dropout, "use_rslora": use_rslora}
        """This layer's settings under adapter_config.json's names (what save_adapter writes)."""
        self.mode = "train"
        # buffers, so that model.to(device) moves them; not persistent: the state dict stays PEFT-free
        self.register_buffer("reference_A", None, persistent=False)
        self.register_buffer("reference_B", None, persistent=False)

    @property
    def reference(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The frozen starting adapter (A, B) that `keep_as_reference` kept, or None."""
        return None if self.reference_A is None else (self.reference_A, self.reference_B)

    def adapter(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (A, B) this layer computes with in its mode; None: the base alone."""
        return (self.lora_A, self.lora_B) if self.mode == "train" else self.reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        adapter = self.adapter()
        if adapter is None:
            return out
        A, B = adapter
        x = x.to(A.dtype)
        if self.mode == "train":
            x = self.dropout(x)
        # in place, the same bits as (out + delta * s).to(out.dtype): a bf16 add computes in fp32
        # and rounds once; two [*, out] temporaries fewer per layer (neither is saved for backward)
        delta = F.linear(F.linear(x, A), B).mul_(self.scaling)
        return out.add_(delta)

    @property
    def weight(self) -> torch.Tensor:
        """The merged weight W + scaling * B @ A `[out, in]` of this mode's adapter, detached, in W's
        dtype: what the rollout engine copies once per rollout (decoding then costs no more)."""
        W = self.base.weight.detach()
        adapter = self.adapter()
        if adapter is None:
            return W
        A, B = adapter
        return (W + (B.detach() @ A.detach()) * self.scaling).to(W.dtype)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """Every LoraLinear of `model` by module name, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def projections(model: nn.Module) -> list[str]:
    """The names of the modules LoRA can wrap (every q_proj ... down_proj), in module order."""
    return [name for name, _ in model.named_modules() if name.rpartition(".")[2] in TARGETS]


def replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def wrap(model: nn.Module, names: list[str], r: int, alpha: float, dropout: float, use_rslora: bool) -> list[str]:
    """Freeze every parameter, then wrap the modules `names` in LoraLinear (whose adapters train)."""
    if lora_layers(model):
        raise ValueError("the model already has LoRA adapters; apply_lora once per model")
    if type(r) is not int or r < 1 or not 0 <= dropout < 1:
        raise ValueError(f"LoRA r = {r!r} must be a positive integer and dropout = {dropout!r} in [0, 1)")
    model.requires_grad_(False)
    for name in names:  # in the model's train/eval mode, which turns dropout on or off
        layer = LoraLinear(model.get_submodule(name), r, alpha, dropout, use_rslora).train(model.training)
        replace(model, name, layer)
    return names


def apply_lora(model: Transformer, r: int, alpha: float, dropout: float = 0.0,
               target_modules: str | Sequence[str] = "all-linear", use_rslora: bool = False) -> list[str]:
    """Replace each targeted projection by a LoraLinear (in place) and freeze every other parameter;
    return the wrapped module names. target_modules: "all-linear" (the seven projections of every
    layer; never lm_head, as in PEFT) or a list of TARGETS names."""
    if target_modules == "all-linear":
        wanted = set(TARGETS)
    else:
        wanted = {target_modules} if isinstance(target_modules, str) else set(target_modules)
        unknown = sorted(wanted - set(TARGETS))
        if unknown or isinstance(target_modules, str):
            raise ValueError(f"LoRA target_modules = {target_modules!r}: unknown {unknown or target_modules!r}; "
                             f"give 'all-linear' or a list of {', '.join(TARGETS)}")
    return wrap(model, [n for n in projections(model) if n.rpartition(".")[2] in wanted],
                r, alpha, dropout, use_rslora)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable adapter parameters, A then B of each layer, in module order."""
    return [p for layer in lora_layers(model).values() for p in (layer.lora_A, layer.lora_B)]


@contextlib.contextmanager
def reference_adapters(model: nn.Module) -> Iterator[None]:
    """Inside, every LoraLinear computes with its reference adapter (without dropout): none, the base
    alone, for a run that started from the base model, or the frozen starting adapter for a run that
    started from an existing one. The KL reference is the run's starting point, with no second model.
    Run the reference pass without autograd: a gradient-checkpointed backward after leaving would
    recompute its layers with the trained adapters."""
    layers = lora_layers(model).values()
    for layer in layers:
        layer.mode = "reference"
    try:
        yield
    finally:
        for layer in layers:
            layer.mode = "train"


@torch.no_grad()
def keep_as_reference(model: nn.Module) -> None:
    """Copy the current adapters (the starting adapter, just loaded) as every layer's frozen reference."""
    for layer in lora_layers(model).values():
        layer.reference_A, layer.reference_B = layer.lora_A.detach().clone(), layer.lora_B.detach().clone()


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's keys: base_model.model.<module name>.lora_A.weight / .lora_B.weight."""
    return {f"{PREFIX}{name}.lora_{half}.weight": getattr(layer, f"lora_{half}").detach()
            for name, layer in lora_layers(model).items() for half in "AB"}


def save_adapter(model: Transformer, path: str | os.PathLike, base_model_name_or_path: str) -> Path:
    """Write path/adapter_model.safetensors + path/adapter_config.json as PEFT writes them, into
    `<path>.tmp` first and renamed into place, so a crash never leaves a half-written adapter."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters to save; apply_lora or load_adapter first")
    short = sorted({name.rpartition(".")[2] for name in layers}, key=TARGETS.index)
    everywhere = [n for n in projections(model) if n.rpartition(".")[2] in short] == list(layers)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
              "revision": None, **next(iter(layers.values())).config,
              "target_modules": short if everywhere else list(layers),  # names, or full names for a subset
              "init_lora_weights": True, "inference_mode": True, **PLAIN}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in adapter_state_dict(model).items()}, tmp / ADAPTER_WEIGHTS,
              metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    fsync_dir(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    return path


def read_adapter_config(path: str | os.PathLike) -> dict:
    """adapter_config.json of the adapter directory `path`, checked: a PEFT LoRA adapter with nothing
    rlcore cannot apply (DoRA and other variants, bias or extra trained modules, per-layer ranks)."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; a PEFT adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    config = read_json(file)
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{file}: peft_type = {config.get('peft_type')!r}; rlcore loads LoRA adapters only "
                              f"(peft_type 'LORA')")
    for key in (*PLAIN, *NEWER_OPTIONS):
        if config.get(key) and config[key] != PLAIN.get(key):
            raise CheckpointError(f"{file}: {key} = {json.dumps(config[key])} is not plain LoRA, which is all rlcore "
                                  f"applies; merge the adapter into its base with PEFT (merge_and_unload) and "
                                  f"start from the merged model")
    if config.get("init_lora_weights") == "mica":  # a variant with its own forward, chosen by its init
        raise CheckpointError(f"{file}: init_lora_weights = 'mica' is a LoRA variant rlcore does not apply")
    r, alpha, dropout = config.get("r"), config.get("lora_alpha"), config.get("lora_dropout", 0.0)
    if not (type(r) is int and r > 0 and type(alpha) in (int, float) and type(dropout) in (int, float)
            and 0 <= dropout < 1):  # type(), not isinstance: true is not a rank
        raise CheckpointError(f"{file}: r = {r!r}, lora_alpha = {alpha!r}, lora_dropout = {dropout!r}; r must be a "
                              f"positive integer, lora_alpha a number and lora_dropout a number in [0, 1)")
    if not isinstance(config.get("target_modules"), (str, list)):
        raise CheckpointError(f"{file}: target_modules = {config.get('target_modules')!r} must be a list of "
                              f"module names or a regular expression")
    return config


def targeted(model: Transformer, target_modules: str | list[str], file: Path) -> list[str]:
    """The projections that adapter_config.json's target_modules selects, by PEFT's rule: a string is
    a regular expression the whole module name must match ("all-linear": every linear layer but the
    output one), a list holds names a module name equals or ends with after a dot. (Adapters on other
    modules, lm_head say, show as unexpected tensors in the weights file.)"""
    if target_modules == "all-linear":
        return projections(model)
    if isinstance(target_modules, str):
        chosen = [n for n in projections(model) if re.fullmatch(target_modules, n)]
    else:
        chosen = [n for n in projections(model)
                  if n in target_modules or any(n.endswith(f".{t}") for t in target_modules)]
    if not chosen:
        raise CheckpointError(f"{file}: target_modules = {target_modules!r} selects none of the modules rlcore "
                              f"applies LoRA to ({', '.join(TARGETS)})")
    return chosen


@torch.no_grad()
def load_adapter(model: Transformer, path: str | os.PathLike) -> None:
    """Load the PEFT LoRA adapter in directory `path`: apply LoRA as its adapter_config.json says
    (when the model has none yet; else the model's must match it), then its weights, in fp32.
    Errors name the file and the problem (unsupported options, missing keys, shape mismatch)."""
    config = read_adapter_config(path)
    config_file, file = Path(path) / ADAPTER_CONFIG, Path(path) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (only safetensors adapters are read; convert an "
                              f"adapter_model.bin by loading it with PEFT and saving it again)")
    names = targeted(model, config["target_modules"], config_file)
    layers = lora_layers(model)
    if not layers:
        wrap(model, names, config["r"], config["lora_alpha"], config.get("lora_dropout", 0.0),
             bool(config.get("use_rslora", False)))
        layers = lora_layers(model)
    scaling = lora_scaling(config["r"], config["lora_alpha"], bool(config.get("use_rslora", False)))
    for name, layer in layers.items():
        if layer.scaling != scaling:
            raise CheckpointError(f"{config_file}: scaling {scaling} (from r, lora_alpha, use_rslora) differs from "
                                  f"the model's LoRA scaling {layer.scaling} at {name}")
    expected = adapter_state_dict(model)
    with open_weights(file) as f:
        stored = {key: f.get_tensor(key) for key in f.keys()}
    problems = [f"{what} {listed(sorted(keys))}" for what, keys in
                (("missing", expected.keys() - stored.keys()), ("unexpected", stored.keys() - expected.keys())) if keys]
    if problems:
        raise CheckpointError(f"{file}: tensor names do not match the model's LoRA layers: {', '.join(problems)}; "
                              f"check target_modules in {ADAPTER_CONFIG} (rlcore applies LoRA to "
                              f"{', '.join(TARGETS)} only)")
    for key, param in expected.items():
        if stored[key].shape != param.shape:
            raise CheckpointError(f"{file}: tensor {key} has shape {tuple(stored[key].shape)}, the model's LoRA "
                                  f"layer needs {tuple(param.shape)} (r = {config['r']} in {ADAPTER_CONFIG}); "
                                  f"check that the adapter belongs to this base model")
        param.copy_(stored[key])


@torch.no_grad()
def merge_lora(model: Transformer) -> None:
    """Replace every LoraLinear by its base nn.Linear holding W + scaling * B @ A (for export): the
    model's state_dict is then the base model's, the HF checkpoint transformers loads."""
    for name, layer in lora_layers(model).items():
        layer.base.weight.copy_(layer.weight)
        replace(model, name, layer.base)


def set_dropout(model: nn.Module, p: float) -> None:
    """Set every adapter's dropout probability (a training setting, not part of an adapter: a run
    from an existing adapter takes lora.dropout, not the adapter_config.json it was saved with)."""
    for layer in lora_layers(model).values():
        layer.dropout = nn.Dropout(p) if p > 0 else nn.Identity()
        layer.config["lora_dropout"] = p
