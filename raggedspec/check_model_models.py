"""The models `raggedspec check-model` runs: tiny, randomly initialised, seeded Hugging Face
causal LMs built from a config (nothing is downloaded), or a user's `module:factory`.

`Subject` is what a check runs against: `model(kv_heads, window)` builds (once per key) a
model with that many KV heads of 4 query heads and that sliding window, in the subject's
attention implementation and dtype. A built-in architecture gets `TINY` (2 layers, hidden
32, head dim 8, vocabulary 96, weights N(0, 0.2) so attention is far from uniform) plus
its own keys from `ARCH_KEYS`; a window is set as `sliding_window` (and on every layer where
the config lists layer types), none as every layer full attention. A factory is called with
the keyword arguments its signature names among `attn_implementation`, `dtype`,
`sliding_window`, `num_key_value_heads` and `seed`; it is loaded by the one plug-in loader
(`reference.plugins`), and an exception inside it is a `PluginError`, which the command line
reports as "raised by your factory" with its traceback (exit 1).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, head_dim=8, max_position_embeddings=512,
            initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
"""Config keys every built-in architecture gets."""
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
           topk_group=1, experts_implementation="eager")
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=8)
ARCH_KEYS: dict[str, dict] = {
    "deepseek_v2": MOE | MLA,
    "deepseek_v3": MOE | MLA,
    "qwen2_moe": MOE, "qwen3_moe": MOE, "mixtral": MOE, "olmoe": MOE, "phimoe": MOE,
    "gemma2": dict(query_pre_attn_scalar=8),
    "gemma3_text": dict(query_pre_attn_scalar=8),
    "qwen2": dict(use_sliding_window=False, max_window_layers=0),
    "qwen3": dict(use_sliding_window=False, max_window_layers=0),
}
"""Extra config keys per architecture (MoE sizes with the eager experts loop, which runs in
float64; multi-head latent attention ranks); any other architecture gets the MoE sizes
(keys its config does not use are inert)."""
ONE_KV_LAYOUT = {"deepseek_v2", "deepseek_v3"}
"""Multi-head latent attention: one key per query head (no GQA), so 4 KV heads only."""
NAMED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "deepseek_v3")
"""The architectures named on the findings page first."""
DTYPES = {"float32": torch.float32, "float64": torch.float64}
IMPLS = ("eager", "sdpa", "flex_attention")
"""The attention implementations of transformers that run on a CPU."""
SEED = 0


class Unsupported(ValueError):
    """transformers refuses to build the architecture with this implementation or dtype."""


class NoWindow(ValueError):
    """The subject cannot take a sliding window (its architecture has none)."""


def import_transformers():
    """transformers, or ImportError naming the extra to install."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("check-model needs transformers: pip install 'raggedspec[models]'") \
            from exc
    transformers.logging.set_verbosity_error()
    return transformers


def _layer_types(config, window: int | None) -> None:
    """Every layer full attention (no window), or the config's own sliding layers kept and
    every layer sliding when the config lists no sliding layer."""
    types = getattr(config, "layer_types", None)
    if types is None:
        return
    if window is None:
        config.layer_types = ["full_attention"] * len(types)
    elif "sliding_attention" not in types:
        config.layer_types = ["sliding_attention"] * len(types)


def tiny_config(arch: str, kv_heads: int, window: int | None):
    """The architecture's config at `TINY` size with `kv_heads` KV heads and `window`."""
    transformers = import_transformers()
    keys = TINY | ARCH_KEYS.get(arch, MOE) | dict(num_key_value_heads=kv_heads)
    if window is not None:
        keys |= dict(sliding_window=window, use_sliding_window=True)
    config = transformers.AutoConfig.for_model(arch, **keys)
    if window is not None and not hasattr(type(config)(), "sliding_window"):
        raise NoWindow(f"{arch}'s config has no sliding_window")
    if window is None and getattr(config, "layer_types", None) is None \
            and hasattr(config, "sliding_window"):
        config.sliding_window = None
    _layer_types(config, window)
    return config


def model_windows(model) -> set:
    """The sliding windows the model's attention modules use (None for a full layer)."""
    config = getattr(model, "config", None)
    found = {layer_window(m, config) for m in attention_modules(model)}
    return found or {None}


def layer_window(module, config) -> int | None:
    """An attention module's sliding window: its own `sliding_window`, else its config's
    (for its layer type when the config lists layer types)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types is not None and idx is not None and idx < len(types):
        return window if types[idx] == "sliding_attention" else None
    return window


def attention_modules(model) -> list:
    """The modules whose class name ends in "Attention" and that have a `layer_idx` or an
    attention mask argument: the self-attention of each decoder layer."""
    out = []
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("Attention") and (hasattr(m, "layer_idx") or _takes_mask(m)):
            out.append(m)
    return out


def _takes_mask(module) -> bool:
    try:
        return "attention_mask" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def build_tiny(arch: str, impl: str, dtype: str, kv_heads: int, window: int | None):
    """A seeded random tiny model of `arch`; NoWindow when a window was asked for and the
    architecture built none."""
    transformers = import_transformers()
    config = tiny_config(arch, kv_heads, window)
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    model = model.to(DTYPES[dtype]).eval()
    if window is not None and window not in model_windows(model):
        raise NoWindow(f"{arch} builds no sliding-window layer")
    return model


# ----------------------------------------------------------------------------- factories


def load_factory(spec: str) -> Callable:
    """`module:attr` -> the callable, through the one plug-in loader (`reference.plugins`:
    the working folder first on sys.path); ValueError naming what is missing, PluginError
    when importing the module raises."""
    from raggedspec.reference.plugins import PluginSpecError, load_object

    try:
        return load_object(spec, "factory", "a model factory is a function returning a model")
    except PluginSpecError as exc:
        raise ValueError(f"--arch {spec!r}: {exc}") from None


def factory_kwargs(factory: Callable, impl: str, dtype: str, kv_heads: int,
                   window: int | None) -> dict:
    """The keyword arguments the factory's signature names (all of them for `**kwargs`)."""
    offered = dict(attn_implementation=impl, dtype=DTYPES[dtype], sliding_window=window,
                   num_key_value_heads=kv_heads, seed=SEED)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return offered
    return {k: v for k, v in offered.items() if k in params}


def build_from_factory(factory: Callable, spec: str, impl: str, dtype: str, kv_heads: int,
                       window: int | None):
    """The factory's model in eval mode and `dtype`; PluginError for its own exception."""
    from raggedspec.reference.plugins import Plugin, PluginError

    kwargs = factory_kwargs(factory, impl, dtype, kv_heads, window)
    try:
        model = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 (the user's code: reported as theirs)
        raise PluginError(Plugin("factory", spec), f" when called with {kwargs}") from exc
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--arch {spec}: your factory returned a {type(model).__name__}, not "
                         f"a torch.nn.Module (a causal LM)")
    return model.to(DTYPES[dtype]).eval()


class Subject:
    """One (architecture or factory, implementation, dtype): its models, built once per
    `(kv_heads, window)`, and what it can vary."""

    def __init__(self, arch: str, impl: str, dtype: str, factory: Callable | None = None) -> None:
        """`arch` a transformers model type or `module:factory`; or any name with the
        `factory` callable itself."""
        self.arch, self.impl, self.dtype = arch, impl, dtype
        self.factory = factory or (load_factory(arch) if ":" in arch else None)
        self._models: dict = {}

    @property
    def name(self) -> str:
        return f"{self.arch} / {self.impl} / {self.dtype}"

    def kv_heads(self) -> tuple[int, ...]:
        """KV head counts to draw (of 4 query heads); a factory that takes no
        `num_key_value_heads` has its own."""
        if self.factory is None:
            return (4,) if self.arch in ONE_KV_LAYOUT else (1, 2, 4)
        named = factory_kwargs(self.factory, self.impl, self.dtype, 2, None)
        return (1, 2, 4) if "num_key_value_heads" in named else (0,)

    def takes_window(self) -> bool:
        """Whether cases may ask for a sliding window."""
        if self.factory is not None:
            return "sliding_window" in factory_kwargs(self.factory, self.impl, self.dtype, 2, 1)
        try:
            self.model(self.kv_heads()[-1], 4)
        except (NoWindow, Unsupported):  # no window, or a config that refuses one
            return False
        return True

    def model(self, kv_heads: int, window: int | None):
        """The model for a case (built once per key); Unsupported when transformers refuses
        to build the architecture this way, NoWindow when it builds no window."""
        key = (kv_heads, window)
        if key not in self._models:
            if self.factory is not None:
                self._models[key] = build_from_factory(self.factory, self.arch, self.impl,
                                                       self.dtype, kv_heads, window)
                return self._models[key]
            try:
                self._models[key] = build_tiny(self.arch, self.impl, self.dtype, kv_heads,
                                               window)
            except NoWindow:
                raise
            except Exception as exc:  # noqa: BLE001 (transformers' own refusal, in its words)
                raise Unsupported(f"{self.arch} with {self.impl} in {self.dtype}: transformers "
                                  f"does not build it: {type(exc).__name__}: "
                                  f"{str(exc)[:300]}") from exc
        return self._models[key]

    def vocab(self) -> int:
        model = self.model(*self.any_key())
        size = getattr(getattr(model, "config", None), "vocab_size", None)
        return int(size) if size else int(model.get_output_embeddings().weight.shape[0])

    def any_key(self) -> tuple[int, None]:
        return self.kv_heads()[-1], None
