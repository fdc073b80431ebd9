"""The main job's shortcut flags: aliases of config fields, in one table.

This module owns :data:`FLAG_ALIASES` (each shortcut flag of
``experiments.train``, such as ``--model``, ``--cluster`` or ``--plan``, and
the config field it sets) and :func:`apply_overrides`, which applies their
values to a config. The binary defines its flags from the table.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from typing import Any

import ml_collections

from experiments.config_fields import read_json
from experiments.config_fields import to_plain


@dataclasses.dataclass(frozen=True)
class FlagAlias:
  """A shortcut flag of the main job for a config field.

  Attributes:
    flag: the flag's name, without ``--``.
    field: the config field it sets, dotted (``"distributed.process_id"``).
    type: the absl flag type: ``"string"``, ``"bool"``, ``"integer"``,
      ``"float"``, ``"enum"`` or ``"multi_string"``.
    help: the flag's help text.
    apply: how a given value reaches the config (:func:`apply_overrides`):
      ``"set"`` replaces the field; ``"merge"`` reads a JSON object and
      merges it into the field (a mapping); ``"plans"`` reads the repeated
      ``auto`` or ``KIND=PLAN.json`` values into ``plan_mode`` and the
      ``plans`` mapping.
    choices: the values of an ``"enum"`` flag.
  """

  flag: str
  field: str
  type: str
  help: str
  apply: str = "set"
  choices: tuple[str, ...] = ()


#: The main job's shortcut flags. ``--flag=value`` does what
#: ``--config.field=value`` would (``"merge"`` and ``"plans"`` flags
#: combine with the config's value instead); an unset flag leaves the field
#: as the config has it. The binary defines one flag per entry, in this
#: order, which is also the order they are applied and checked in.
FLAG_ALIASES: tuple[FlagAlias, ...] = (
  FlagAlias(
    "model",
    "model",
    "string",
    "Overrides config.model: a built-in model (cnn, resnet18, resnet50, "
    "vgg16_bn, bert, lm, vit_tiny) or package.module:factory, a callable "
    "taking rngs, the dataset's facts it names (num_classes, input_shape, "
    "image_size, in_channels, max_len, vocab_size) and the keyword "
    "arguments of --model_kwargs, that returns an NNX module, a Linen "
    "module or an (init, apply) pair (no special methods needed; "
    "--config.loss_fn=package.module:fn sets the loss).",
  ),
  FlagAlias(
    "model_kwargs",
    "model_kwargs",
    "string",
    "JSON object merged into config.model_kwargs (the model's keyword "
    "arguments).",
    apply="merge",
  ),
  FlagAlias(
    "dataset_kwargs",
    "dataset_kwargs",
    "string",
    "JSON object merged into config.dataset_kwargs (the dataset loader's "
    "arguments).",
    apply="merge",
  ),
  FlagAlias("cluster", "cluster", "string", "Overrides config.cluster."),
  FlagAlias("resume", "resume", "bool", "Overrides config.resume."),
  FlagAlias(
    "sync",
    "sync",
    "enum",
    "Overrides config.sync: when workers average (qsr, QSR local SGD, "
    "needs a decaying learning rate such as --config.lr_schedule=cosine: "
    "the period grows as the learning rate decays).",
    choices=("dp", "local", "postlocal", "qsr"),
  ),
  FlagAlias(
    "h_base",
    "h_base",
    "integer",
    "Overrides config.h_base: the local-SGD period, or QSR's smallest one.",
  ),
  FlagAlias(
    "alpha",
    "alpha",
    "float",
    "Overrides config.alpha: QSR's growth coefficient, "
    "H = max(h_base, floor((alpha / lr)^2)); unset: learning_rate * "
    "sqrt(h_base), the period h_base at the peak learning rate.",
  ),
  FlagAlias(
    "compress",
    "compress",
    "enum",
    "Overrides config.compress: what goes on the wire (what each average "
    "sends: gradients under dp, the parameters' change under local SGD).",
    choices=("none", "fp16", "bf16", "gqsgd", "gqsgd_exp", "qsgd", "powersgd"),
  ),
  FlagAlias(
    "plan",
    "plans",
    "multi_string",
    "'auto' (the allocator chooses every kind's plan; the default config's "
    "mode) or KIND=PLAN.json: the precision plan of one device kind "
    "(repeatable; sets config.plan_mode=manual, and kinds not named train "
    "in FP32).",
    apply="plans",
  ),
  FlagAlias(
    "coordinator_address",
    "distributed.coordinator_address",
    "string",
    "Overrides config.distributed.coordinator_address: host:port of "
    "process 0's coordination service; default: from the launcher.",
  ),
  FlagAlias(
    "num_processes",
    "distributed.num_processes",
    "integer",
    "Overrides config.distributed.num_processes: processes in the run; "
    "default: from the launcher.",
  ),
  FlagAlias(
    "process_id",
    "distributed.process_id",
    "integer",
    "Overrides config.distributed.process_id: this process's index; "
    "default: from the launcher.",
  ),
)


def _plan_values(values: list[str]) -> dict[str, str]:
  """``{kind: plan}`` of repeated ``--plan=KIND=PLAN.json`` values."""
  plans = {}
  for value in values:
    if value == "auto":
      raise ValueError(
        "--plan=auto cannot be combined with KIND=PLAN.json plans"
      )
    kind, sep, path = value.partition("=")
    if not sep or not kind or not path:
      named_file = not sep and ("/" in value or value.endswith(".json"))
      raise ValueError(
        f"--plan={value!r}: expected KIND=PLAN.json, the device kind the "
        "plan is for and the plan, e.g. --plan=t4="
        + (value if named_file else "plans/t4.json")
      )
    kind = kind.strip().lower()
    if kind in plans:
      raise ValueError(
        f"--plan gives two plans for {kind}: {plans[kind]!r} and {path!r}"
      )
    plans[kind] = path
  return plans


def _set_field(
  config: ml_collections.ConfigDict, field: str, value: Any
) -> None:
  """Sets the dotted ``field`` of ``config``, adding missing sections."""
  *parents, name = field.split(".")
  node = config
  for parent in parents:
    if parent not in node:
      node[parent] = ml_collections.ConfigDict()
    node = node[parent]
  node[name] = value


def apply_overrides(
  config: ml_collections.ConfigDict, overrides: Mapping[str, Any]
) -> None:
  """Applies the shortcut flags' values to ``config``, in place.

  Args:
    config: the job's config (locked or not).
    overrides: ``{flag: value}`` for entries of :data:`FLAG_ALIASES`; a value
      of None (or an empty list for ``--plan``) leaves its field alone.

  Raises:
    ValueError: a flag this table lacks, a ``"merge"`` value that is not a
      JSON object, or a bad ``--plan`` value.
  """
  aliases = {alias.flag: alias for alias in FLAG_ALIASES}
  unknown = sorted(set(overrides) - set(aliases))
  if unknown:
    raise ValueError(f"unknown flag(s) {unknown}; valid: {', '.join(aliases)}")
  for alias in FLAG_ALIASES:
    value = overrides.get(alias.flag)
    if value is None or (alias.apply == "plans" and not value):
      continue
    with config.unlocked():
      if alias.apply == "set":
        _set_field(config, alias.field, value)
      elif alias.apply == "merge":
        merged = read_json(value, f"--{alias.flag}")
        if not isinstance(merged, dict):
          raise ValueError(
            f"--{alias.flag} must be a JSON object, got {value!r}"
          )
        config[alias.field] = ml_collections.ConfigDict(
          {**to_plain(config[alias.field]), **merged}
        )
      elif list(value) == ["auto"]:
        config.plan_mode = "auto"
      else:
        plans = _plan_values(list(value))
        config.plan_mode = "manual"
        config[alias.field] = ml_collections.ConfigDict(
          {**to_plain(config[alias.field]), **plans}
        )
