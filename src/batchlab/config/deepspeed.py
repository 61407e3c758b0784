"""DeepSpeed's ``zero_optimization`` sizes a run's ds_config sets (``--deepspeed``), for the formula's pricing of
DeepSpeed's own buffers (formula/deepspeed.py).  Pure Python.

Typed as ``key=value`` pairs joined by commas, in the ds_config's own key names; a value is a number of elements
(``5e8``) or ``auto``, which Hugging Face's Trainer integration fills from the model's hidden size h
(transformers/integrations/deepspeed.py ``trainer_config_finalize``: reduce_bucket_size h^2,
stage3_prefetch_bucket_size 0.9 h^2, stage3_param_persistence_threshold 10 h).  ``hf-auto`` is the three at
``auto``, as the ds_config files of HF-Trainer recipes (Qwen, ms-swift, LLaMA-Factory) set them.  A key not
typed keeps DeepSpeed's default (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from batchlab.config.choices import ConfigError
from batchlab.config.values import finite_number

AUTO = -1  # "auto": filled from the model's hidden size (``resolved``)
MAX_ELEMENTS = 10**13  # a size beyond every model's parameter count (10 trillion elements): a typo, not a setting
# the keys Hugging Face's integration fills when set to "auto", as multiples of h^2 (or h)
_AUTO_FILL = {"reduce_bucket_size": (1.0, 2), "stage3_prefetch_bucket_size": (0.9, 2),
              "stage3_param_persistence_threshold": (10.0, 1)}


@dataclass(frozen=True)
class DeepSpeedSettings:
    """zero_optimization sizes in elements (DeepSpeedZeroConfig's defaults), or ``AUTO``."""

    reduce_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    # None: DeepSpeed's default (on at stage 3, off at stages 1 and 2); stages 1-2 double their reduce bucket with it
    overlap_comm: bool | None = None

    def __post_init__(self):
        if self.overlap_comm not in (None, True, False):
            raise ConfigError("deepspeed", f"overlap_comm must be true or false, got {self.overlap_comm!r}")
        for f in fields(self):
            if f.name == "overlap_comm":
                continue
            v = getattr(self, f.name)
            if (not isinstance(v, int) or isinstance(v, bool) or v > MAX_ELEMENTS
                    or (v < 0 and not (v == AUTO and f.name in _AUTO_FILL))):
                raise ConfigError("deepspeed", f"{f.name} must be a whole number of elements from 0 to "
                                               f"{MAX_ELEMENTS:.0e}{' or auto' if f.name in _AUTO_FILL else ''}, "
                                               f"got {v!r}")

    @classmethod
    def parse(cls, value) -> "DeepSpeedSettings":
        if isinstance(value, DeepSpeedSettings):
            return value
        if value is None or str(value).strip() in ("", "default"):
            return cls()
        if not isinstance(value, str):  # a TOML table or list: the flag's one string is what is read
            raise ConfigError("deepspeed", f"a string: hf-auto or KEY=VALUE,... (e.g. \"reduce_bucket_size=5e8\"), "
                                           f"got {type(value).__name__} {value!r}")
        out, names = cls(), {f.name for f in fields(cls)}
        for item in str(value).split(","):
            item = item.strip()
            if item == "hf-auto":
                out = replace(out, **{k: AUTO for k in _AUTO_FILL})
                continue
            key, sep, text = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ConfigError("deepspeed", f"{item!r}: expected hf-auto or KEY=VALUE with KEY one of "
                                               f"{', '.join(sorted(names))}")
            out = replace(out, **{key: _elements(key, text.strip())})
        return out

    def resolved(self, hidden: int) -> "DeepSpeedSettings":
        """Every ``auto`` filled as Hugging Face's Trainer fills it for a model of this hidden size."""
        return replace(self, **{k: int(c * hidden ** p) for k, (c, p) in _AUTO_FILL.items() if getattr(self, k) == AUTO})

    def typed(self) -> dict[str, int | bool | str]:
        """The ds_config entries that differ from DeepSpeed's defaults, in its spelling (``auto`` kept)."""
        default = DeepSpeedSettings()
        return {f.name: "auto" if getattr(self, f.name) == AUTO and f.name in _AUTO_FILL else getattr(self, f.name)
                for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    def ignored(self, stage: int, dp: int) -> list[str]:
        """The typed sizes a DeepSpeed ZeRO-``stage`` engine over ``dp`` ranks never reads, with why."""
        typed = self.typed()
        if typed and dp < 2:
            return [f"--deepspeed {self}: one data-parallel rank shards nothing, DeepSpeed's buffers are not priced"]
        unread = [k for k in typed if stage < 3 and (k.startswith("stage3_") or k == "sub_group_size")]
        return [f"--deepspeed {', '.join(unread)}: stage 3's settings, unread at ZeRO-{stage}"] if unread else []

    def __str__(self) -> str:
        return ",".join(f"{k}={str(v).lower()}" for k, v in self.typed().items()) or "default"


def _elements(key: str, text: str) -> int | bool:
    if key == "overlap_comm":
        if text.lower() not in ("true", "false"):
            raise ConfigError("deepspeed", f"overlap_comm={text!r}: expected true or false")
        return text.lower() == "true"
    if text.lower() == "auto":
        if key not in _AUTO_FILL:
            raise ConfigError("deepspeed", f"{key}=auto: only {', '.join(_AUTO_FILL)} take auto")
        return AUTO
    try:
        number = finite_number(key, text, minimum=0, maximum=MAX_ELEMENTS)
    except ConfigError:
        raise ConfigError("deepspeed", f"{key}={text!r}: expected a whole number of elements from 0 to "
                                       f"{MAX_ELEMENTS:.0e} (5e8) or auto") from None
    if number != int(number):
        raise ConfigError("deepspeed", f"{key}={text!r}: expected a whole number of elements")
    return int(number)
