"""Tests for Precision, the device capability table and PrecisionPlan."""

import json
import re
import time

import pytest

import qsync_jax as qs
from qsync_jax.numerics.precision import Precision


def test_parse_names_and_errors():
  assert Precision.parse("INT8") is Precision.INT8
  assert Precision.parse(Precision.BF16) is Precision.BF16
  with pytest.raises(ValueError, match=r"unknown precision 'int4'.*fp32"):
    Precision.parse("int4")


def test_bits_order():
  assert [
    p.bits
    for p in (Precision.INT8, Precision.FP16, Precision.TF32, Precision.FP32)
  ] == [8, 16, 19, 32]


def test_capability_table_matches_the_hardware():
  v100 = qs.supported_precisions("v100")
  t4 = qs.supported_precisions("t4")
  assert Precision.INT8 not in v100 and Precision.BF16 not in v100
  assert Precision.INT8 in t4 and Precision.FP8 not in t4
  assert Precision.BF16 not in t4
  assert Precision.FP8 in qs.supported_precisions("h100")
  assert Precision.FP8 in qs.supported_precisions("l4")
  assert Precision.FP8 not in qs.supported_precisions("a100")
  assert qs.supported_precisions("cpu") == frozenset(Precision)
  assert set(qs.device_kinds()) == {
    "cpu",
    "t4",
    "v100",
    "a10",
    "l4",
    "a100",
    "h100",
    "h200",
    "l40s",
  }
  with pytest.raises(ValueError, match="unknown device kind 'k80'"):
    qs.supported_precisions("k80")


def test_resolve_first_match_wins_with_fullmatch():
  plan = qs.PrecisionPlan(
    [(r"conv\d", "int8"), (r"conv.*", "fp16"), ("fc", Precision.BF16)],
    default="fp32",
  )
  got = plan.resolve(["conv1", "conv10", "conv_a", "fc", "fc2", "head"])
  assert got == {
    "conv1": Precision.INT8,
    "conv10": Precision.FP16,
    "conv_a": Precision.FP16,
    "fc": Precision.BF16,
    "fc2": Precision.FP32,
    "head": Precision.FP32,
  }


def test_rule_matching_no_layer_lists_valid_paths():
  plan = qs.PrecisionPlan([("convv1", "int8")])
  with pytest.raises(qs.PlanError) as e:
    plan.resolve(["conv1", "fc"])
  assert "'convv1' match no layer" in str(e.value)
  assert "conv1, fc" in str(e.value)
  assert plan.resolve(["conv1"], strict=False) == {"conv1": Precision.FP32}


def test_json_round_trip():
  plan = qs.PrecisionPlan(
    [(r"layers/\d+/attn/.*", "fp16"), ("conv0", "int8"), ("x", "fp8")],
    default="bf16",
    quant=qs.QuantConfig(granularity="channel", rounding="stochastic"),
  )
  text = plan.to_json()
  back = qs.PrecisionPlan.from_json(text)
  assert back == plan
  assert json.loads(text)["quant"] == {
    "granularity": "channel",
    "rounding": "stochastic",
  }
  assert qs.PrecisionPlan.from_json(back.to_json(indent=None)) == plan


@pytest.mark.parametrize(
  "text, message",
  [
    ("{not json", "malformed plan JSON"),
    ("[1, 2]", "a plan must be a JSON object"),
    ('{"rules": [["a", "int3"]]}', "unknown precision 'int3'"),
    ('{"rules": [["a"]]}', "rule 0 must be a \\(regex, precision\\) pair"),
    ('{"rules": [["(", "int8"]]}', "invalid regex"),
    ('{"rules": "a"}', "'rules' must be a list"),
    ('{"default": "fp64"}', "unknown precision 'fp64'"),
    ('{"rulez": []}', "unknown plan keys"),
    ('{"quant": {"rounding": "up"}}', "unknown rounding 'up'"),
  ],
)
def test_malformed_plans_raise_one_clear_error(text, message):
  with pytest.raises(qs.PlanError, match=message):
    qs.PrecisionPlan.from_json(text)


@pytest.mark.parametrize(
  "kind, precision",
  [("v100", "int8"), ("t4", "fp8"), ("t4", "bf16"), ("a100", "fp8")],
)
def test_validate_for_rejects_missing_precision(kind, precision):
  plan = qs.PrecisionPlan([("conv1", precision)])
  with pytest.raises(qs.PlanError) as e:
    plan.validate_for(kind)
  assert f"device kind '{kind}' does not support {precision}" in str(e.value)
  assert "conv1" in str(e.value)


def test_validate_for_only_counts_layers_that_resolve():
  # The int8 rule is shadowed for these layers, so v100 is fine.
  plan = qs.PrecisionPlan([("a", "fp16"), ("a|b", "int8")])
  plan.validate_for("v100", ["a"])
  with pytest.raises(qs.PlanError):
    plan.validate_for("v100", ["a", "b"])


def test_from_precisions_builds_exact_rules():
  plan = qs.PrecisionPlan.from_precisions({"a.b[0]": "int8", "c": "fp16"})
  assert plan.resolve(["a.b[0]", "c", "axb0"], strict=False) == {
    "a.b[0]": Precision.INT8,
    "c": Precision.FP16,
    "axb0": Precision.FP32,
  }


# 35 layer paths like a ResNet's, as in the report of the slow rule.
_PATHS = [
  f"blocks/{b}/conv{c}/kernel_weights" for b in range(12) for c in range(1, 4)
][:35]


@pytest.mark.parametrize(
  "rule, what",
  [
    ("([a-z0-9/]+)+!", "holds a quantifier"),
    ("(?:a?)*b", "holds a quantifier"),
    (r"(?:blocks/\d+/)+conv1", "holds a quantifier"),
    ("(?:a|aa)+!", "holds an alternation"),
    ("(?=(?:x+)+)y", "holds a quantifier"),  # Inside a lookahead too.
    (".*.*.*.*.*!", "has 5 repeats, more than 4"),
  ],
)
def test_catastrophic_rules_are_refused(rule, what):
  # Refused by a look at the pattern, before any layer name is matched.
  with pytest.raises(qs.PlanError) as e:
    qs.PrecisionPlan([("conv1", "int8"), (rule, "fp16")])
  msg = str(e.value)
  assert msg.startswith(f"rule 1: regex {rule!r} ") and what in msg
  assert "\n" not in msg
  with pytest.raises(qs.PlanError, match=what):  # From JSON as well.
    qs.PrecisionPlan.from_json(json.dumps({"rules": [[rule, "fp16"]]}))


@pytest.mark.parametrize(
  "rule",
  [
    r"conv\d",
    r"conv.*",
    r"layers/\d+/attn/.*",
    ".*embed",
    "conv1|fc",
    "(?:conv|fc)1",
    "(a|b)+",
    "(?:ab)+c",
    "a?b?c",
    re.escape("a.b[0]"),
    r"blocks/\d+/conv\d+/.*_\w+",
  ],
)
def test_ordinary_rules_are_kept(rule):
  assert qs.PrecisionPlan([(rule, "int8")]).rules[0][0] == rule


def test_most_repeats_allowed_resolve_fast():
  rule = ".*" * qs.plan.precision.MAX_RULE_REPEATS + "!"
  plan = qs.PrecisionPlan([(rule, "int8")])
  start = time.perf_counter()
  got = plan.resolve(_PATHS, strict=False)
  elapsed = time.perf_counter() - start
  assert set(got.values()) == {Precision.FP32}
  assert elapsed < 1.0
