"""Tests for the synchronization schedules (qsync_jax.parallel.schedules).

Steps are 1-based: ``is_sync_step(t)`` is asked after the t-th update, and
the QSR period chosen after ``s`` completed steps reads ``lr_schedule(s)``,
the learning rate of the next update (optax count ``s``).
"""

import copy
import json
import math
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qsync_jax.parallel import schedules


def cosine_lr():
  """Linear warmup 0 -> 0.1 over 10 steps, cosine to 0.001 at step 100."""
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=0.1,
    warmup_steps=10,
    decay_steps=100,
    end_value=0.001,
  )


def qsr_cosine(**kwargs):
  args = dict(total_steps=100, alpha=0.2, h_base=2, warmup_steps=10)
  args.update(kwargs)
  return schedules.QSR(cosine_lr(), **args)


# Hand computation, H = max(2, floor((0.2 / lr(s)) ** 2)) capped at 100 - s,
# with lr(s) = 0.001 + 0.0495 (1 + cos(pi (s - 10) / 90)) after warmup:
#   s < 10 (warmup):  H = init_h = 2          -> syncs 2, 4, 6, 8, 10
#   s = 10: lr 0.1       -> 4.00  -> 4        -> 14
#   s = 14: lr 0.09952   -> 4.04  -> 4        -> 18, 22, 26, 30 likewise
#   s = 30: lr 0.08842   -> 5.12  -> 5        -> 35
#   s = 35: lr 0.08232   -> 5.90  -> 5        -> 40
#   s = 40: lr 0.07525   -> 7.06  -> 7        -> 47
#   s = 47: lr 0.06414   -> 9.72  -> 9        -> 56
#   s = 56: lr 0.04877   -> 16.8  -> 16       -> 72
#   s = 72: lr 0.02282   -> 76.8, capped at 100 - 72 = 28 -> 100
COSINE_SYNCS = [2, 4, 6, 8, 10, 14, 18, 22, 26, 30, 35, 40, 47, 56, 72, 100]


def test_qsr_matches_a_hand_computation_for_a_cosine_schedule():
  q = qsr_cosine()
  assert q.sync_steps(100) == COSINE_SYNCS
  assert [t for t in range(1, 101) if q.is_sync_step(t)] == COSINE_SYNCS
  assert q.period(40) == math.floor((0.2 / (0.001 + 0.0495 * 1.5)) ** 2) == 7
  assert not q.averages_gradients_at(5)


def test_qsr_recomputes_only_after_an_average_on_a_step_schedule():
  # LR 0.1 for optax counts 0..29, 0.01 from count 30: H = 4, then 400.
  lr = optax.piecewise_constant_schedule(0.1, {30: 0.1})
  q = schedules.QSR(lr, total_steps=50, alpha=0.2, h_base=2)
  # The round chosen at s = 28 (LR 0.1) runs past the decay at 30 with
  # H = 4; at s = 32 the LR is 0.01, H = 400 is capped at 50 - 32 = 18.
  assert q.sync_steps(50) == [4, 8, 12, 16, 20, 24, 28, 32, 50]
  # A step just past a sync reads the next step's LR: s = 30 would see 0.01.
  assert q.period(29) == 4 and q.period(30) == 20


def test_qsr_warmup_uses_init_h_and_gamma_selects_the_rule():
  q = qsr_cosine(init_h=1, h_base=1)
  assert q.sync_steps(12) == list(range(1, 11))
  # At s = 72 (lr 0.02282): linear 8.76 -> 8, cubic 672 -> capped at 28.
  assert qsr_cosine(gamma=1).period(72) == 8
  assert qsr_cosine(gamma=3).period(72) == 28
  # At the peak (alpha / lr = 2): linear 2, QSR 4, cubic 8.
  assert [qsr_cosine(gamma=g, h_base=1).period(10) for g in (1, 2, 3)] == [
    2,
    4,
    8,
  ]


def test_qsr_constant_and_degenerate_learning_rates():
  # alpha = 0 keeps init_h, still capped so training ends with an average.
  q = schedules.QSR(0.1, total_steps=10, alpha=0.0, h_base=4)
  assert q.sync_steps(10) == [4, 8, 10]
  # A zero or vanishing LR gives the remaining steps, without overflow.
  assert schedules.QSR(0.0, total_steps=10, alpha=1.0, h_base=1).period(3) == 7
  assert (
    schedules.QSR(1e-300, total_steps=10, alpha=1e10, h_base=1, gamma=3).period(
      0
    )
    == 10
  )
  with pytest.raises(ValueError, match="h_base must be a positive integer"):
    schedules.QSR(0.1, total_steps=10, alpha=0.1, h_base=0)
  with pytest.raises(ValueError, match="alpha >= 0"):
    schedules.QSR(0.1, total_steps=10, alpha=-1.0, h_base=1)


def test_qsr_state_dict_round_trip_resumes_the_same_schedule():
  q = qsr_cosine()
  first = [t for t in range(1, 38) if q.is_sync_step(t)]
  state = json.loads(json.dumps(q.state_dict()))
  assert state == {"h": 5, "next_sync": 40}  # the round 35 -> 40
  resumed = qsr_cosine()
  resumed.load_state_dict(state)
  rest = [t for t in range(38, 101) if resumed.is_sync_step(t)]
  assert first + rest == COSINE_SYNCS
  # Asking about an earlier round replays the rule and keeps the state.
  assert resumed.is_sync_step(14) and not resumed.is_sync_step(15)
  assert resumed.state_dict() == {"h": 28, "next_sync": 100}
  # An empty state (e.g. a checkpoint of a stateless schedule) restarts.
  resumed.load_state_dict({})
  assert resumed.state_dict() == {"h": 2, "next_sync": 2}
  with pytest.raises(ValueError, match="exactly 'h' and 'next_sync'"):
    resumed.load_state_dict({"h": 3})


def test_constant_local_sgd():
  s = schedules.ConstantLocalSGD(4)
  assert s.sync_steps(10) == [4, 8]
  assert schedules.ConstantLocalSGD(4, total_steps=10).sync_steps(10) == [
    4,
    8,
    10,
  ]
  assert not s.averages_gradients_at(4) and not s.is_sync_step(0)
  with pytest.raises(ValueError, match="h must be a positive integer"):
    schedules.ConstantLocalSGD(0)


def test_post_local_sgd():
  s = schedules.PostLocalSGD(switch_step=5, h=3, total_steps=12)
  assert s.sync_steps(12) == [1, 2, 3, 4, 5, 8, 11, 12]
  assert [s.averages_gradients_at(t) for t in (1, 5, 6, 8)] == [
    True,
    True,
    False,
    False,
  ]
  with pytest.raises(ValueError, match="switch_step"):
    schedules.PostLocalSGD(switch_step=-1, h=2)


# Each stateless schedule with its sync steps in 1..20, written out by hand
# from its definition (not from the code under test).
STATELESS = [
  (schedules.EveryStep(), list(range(1, 21))),
  (schedules.ConstantLocalSGD(3, total_steps=20), [3, 6, 9, 12, 15, 18, 20]),
  (schedules.PostLocalSGD(4, 5), [1, 2, 3, 4, 9, 14, 19]),
  # total_steps adds a sync at 19; it does not stop the rule after it.
  (
    schedules.PostLocalSGD(0, 2, total_steps=19),
    [2, 4, 6, 8, 10, 12, 14, 16, 18, 19, 20],
  ),
]


@pytest.mark.parametrize(
  "schedule,expected", STATELESS, ids=[s.name for s, _ in STATELESS]
)
def test_stateless_schedules_agree_and_resume_from_anything(schedule, expected):
  assert schedule.sync_steps(20) == expected
  assert [t for t in range(1, 21) if schedule.is_sync_step(t)] == expected
  assert [
    schedule.round_length(t) for t in range(1, expected[-1] + 1)
  ] == _rounds_from(expected)
  assert schedule.state_dict() == {}
  # Whatever a checkpoint held (nothing, a QSR round), a fresh copy loaded
  # from it mid-run answers as the one that ran.
  for state in ({}, {"h": 4, "next_sync": 8}, qsr_cosine().state_dict()):
    fresh = copy.deepcopy(schedule)
    fresh.load_state_dict(state)
    assert [t for t in range(9, 21) if fresh.is_sync_step(t)] == [
      t for t in expected if t >= 9
    ]
    assert fresh.sync_steps(20) == expected


@pytest.mark.parametrize(
  "schedule",
  [s for s, _ in STATELESS]
  + [qsr_cosine(), qsr_cosine(gamma=1, warmup_steps=0)],
  ids=lambda s: s.name,
)
def test_a_schedule_loaded_from_any_mid_run_state_answers_as_one_that_ran(
  schedule,
):
  total = 100 if isinstance(schedule, schedules.QSR) else 20
  ran = copy.deepcopy(schedule)
  for k in range(total):
    ran.is_sync_step(k)  # the trainer asks after every step
    fresh = copy.deepcopy(schedule)
    fresh.load_state_dict(json.loads(json.dumps(ran.state_dict())))
    assert fresh.state_dict() == ran.state_dict()
    ahead = copy.deepcopy(ran)
    assert [
      (fresh.is_sync_step(t), fresh.round_length(t))
      for t in range(k + 1, total + 1)
    ] == [
      (ahead.is_sync_step(t), ahead.round_length(t))
      for t in range(k + 1, total + 1)
    ], k


def test_every_step_keeps_its_attribute():
  s = schedules.EveryStep()
  assert s.averages_gradients and s.averages_gradients_at(7)
  assert s.is_sync_step(3) and s.sync_steps(3) == [1, 2, 3]


def _rounds_from(syncs):
  """H at every step from a list of sync steps."""
  out, prev = [], 0
  for s in syncs:
    out += [s - prev] * (s - prev)
    prev = s
  return out


def test_round_length_is_the_period_of_each_steps_round():
  q = qsr_cosine()
  assert [q.round_length(t) for t in range(1, 101)] == _rounds_from(
    COSINE_SYNCS
  )
  fresh = qsr_cosine()  # asked in order, as the trainer does, after a sync
  lengths = []
  for t in range(1, 101):
    fresh.is_sync_step(t)
    lengths.append(fresh.round_length(t))
  assert lengths == _rounds_from(COSINE_SYNCS)
  assert fresh.round_length(3) == 2  # an earlier round replays
  local = schedules.ConstantLocalSGD(4, total_steps=10)
  assert [local.round_length(t) for t in range(1, 11)] == [4] * 8 + [2] * 2
  post = schedules.PostLocalSGD(3, 4, total_steps=12)
  assert [post.round_length(t) for t in range(1, 13)] == _rounds_from(
    post.sync_steps(12)
  )
  assert schedules.EveryStep().round_length(7) == 1


def test_make_schedule_builds_each_rule_and_rejects_bad_ones():
  lr = cosine_lr()
  q = schedules.make_schedule(
    "qsr", total_steps=100, lr_schedule=lr, h_base=2, alpha=0.2, warmup_steps=10
  )
  assert q.sync_steps(100) == COSINE_SYNCS and q.name == "qsr"
  assert (
    schedules.make_schedule(
      "qsr", total_steps=100, lr_schedule=lr, alpha=0.2, gamma=3.0
    ).name
    == "qsr_cubic"
  )
  assert schedules.make_schedule("local", total_steps=10, h_base=4).sync_steps(
    10
  ) == [4, 8, 10]
  assert schedules.make_schedule(
    "postlocal", total_steps=10, h_base=4, switch_step=2
  ).sync_steps(10) == [1, 2, 6, 10]
  assert schedules.make_schedule("dp", total_steps=3).sync_steps(3) == [1, 2, 3]
  with pytest.raises(ValueError, match="alpha > 0"):
    schedules.make_schedule("qsr", total_steps=10, lr_schedule=lr, alpha=0.0)
  with pytest.raises(ValueError, match="constant learning rate"):
    schedules.make_schedule("qsr", total_steps=10, lr_schedule=0.1)
  with pytest.raises(ValueError, match="needs the learning-rate"):
    schedules.make_schedule("qsr", total_steps=10, alpha=0.1)
  with pytest.raises(ValueError, match="unknown sync schedule 'ring'"):
    schedules.make_schedule("ring", total_steps=10)


def test_qsr_without_alpha_starts_at_h_base_and_grows_as_the_lr_decays():
  lr = cosine_lr()  # peak 0.1 after 10 warmup steps
  q = schedules.make_schedule(
    "qsr", total_steps=100, lr_schedule=lr, h_base=4, warmup_steps=10
  )
  # alpha = peak * sqrt(h_base): the period is h_base at the peak.
  assert q.alpha == pytest.approx(schedules.default_alpha(0.1, 4)) == 0.2
  assert q.round_length(11) == 4 and q.round_length(100) > 4
  # The paper's ViT-B choice: alpha = 0.0175 for peak 0.008, H_base = 4,
  # i.e. the period at the peak is H_base, as default_alpha makes it.
  assert math.floor((0.0175 / 0.008) ** 2) == 4
  assert math.floor((schedules.default_alpha(0.008, 4) / 0.008) ** 2) == 4
  with pytest.raises(ValueError, match="peak_lr > 0"):
    schedules.default_alpha(0.0, 4)


# The official QSR code (hmgxr128/QSR), transcribed: xscheduler.py's
# schedulers with steps_per_epoch = 1 (so epochs are steps), and the order in
# which trainer_process.py and localopt.LocalOptimizer set the LR and H.
def _official_lr(
  kind, step, max_lr, final_lr, total, warmup, decay_points, gamma, base
):
  if step < warmup:
    return final_lr + step * (max_lr - final_lr) / warmup
  span = total - warmup
  delta_step = min(step - warmup, span)
  if kind == "linear":
    delta_final = span - delta_step
    return final_lr + delta_final * (max_lr - final_lr) / span
  if kind == "step":
    points = np.array([0] + list(decay_points) + [total + 5])
    for i in range(len(points) - 1):
      if step >= points[i] and step < points[i + 1]:
        lr = max_lr * (gamma**i)
    return lr
  lr = final_lr + 0.5 * (max_lr - final_lr) * (
    1 + np.cos(delta_step / span * np.pi)
  )
  if kind == "cosine_step":
    lr = base ** np.round(np.log(lr) / np.log(base))
  return lr


def _official_sync_steps(lr_at, total, alpha, power, min_h, init_h, warmup):
  def adjust_h(step_ctr, lr):
    if step_ctr < warmup or alpha == 0:
      return init_h
    return max(min(max(int((alpha / lr) ** power), min_h), total - step_ctr), 1)

  lr = lr_at(0)
  h, local, syncs = adjust_h(0, lr), 0, []  # once before training
  for step_ctr in range(1, total + 1):
    local += 1  # LocalOptimizer.step
    averaged = local >= h
    if averaged:
      local = 0
      syncs.append(step_ctr)
    lr = lr_at(step_ctr)  # tp_scheduler.adjust_lr: the next step's LR
    if averaged:
      h = adjust_h(step_ctr, lr)
  return syncs


def _lr_config(
  kind,
  *,
  steps,
  learning_rate,
  warmup_steps=0,
  final_learning_rate=1e-6,
  lr_decay_steps=None,
  base=2.0,
):
  from experiments.configs import default

  config = default.get_config()
  config.update(
    dict(
      steps=steps,
      learning_rate=learning_rate,
      lr_schedule=kind,
      warmup_steps=warmup_steps,
      final_learning_rate=final_learning_rate,
      lr_round_base=base,
    )
  )
  config.lr_decay_steps = lr_decay_steps
  return config


# (schedule, steps, peak LR, alpha, gamma, H_base, decay points, base): each
# puts (alpha / lr) ** gamma on integers, where float noise decides the
# floor. In most, the former float32 schedule with a 1e-6 tolerance synced
# elsewhere (0.3 / 0.1 is 2.9999999999999996, the official H 2, not 3).
OFFICIAL_CASES = [
  ("step", 2000, 0.1, 0.02, 2.0, 1, (1000, 1500), 2.0),
  ("step", 600, 0.1, 0.2, 2.0, 2, (200, 400), 2.0),
  ("linear", 500, 0.1, 0.3, 1.0, 1, None, 2.0),
  ("linear", 1000, 0.1, 0.2, 2.0, 1, None, 2.0),
  ("cosine", 500, 0.1, 0.3, 1.0, 1, None, 2.0),
  ("cosine", 1000, 0.1, 0.2, 2.0, 2, None, 2.0),
  ("cosine_step", 600, 0.1, 0.3, 1.0, 1, None, 10.0),
  ("cosine_step", 600, 0.4, 0.1, 2.0, 2, None, 2.0),
]


@pytest.mark.parametrize("warmup", [0, 50])
@pytest.mark.parametrize("case", OFFICIAL_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_qsr_syncs_where_the_official_code_does(case, warmup):
  from experiments import config_lib

  kind, steps, peak, alpha, gamma, h_base, points, base = case
  config = _lr_config(
    kind,
    steps=steps,
    learning_rate=peak,
    warmup_steps=warmup,
    lr_decay_steps=points,
    base=base,
  )
  official_lr = lambda t: _official_lr(
    kind, t, peak, 1e-6, steps, warmup, points or (), 0.1, base
  )
  lr = config_lib.learning_rate(config_lib.parse(config)).float64()
  assert [lr(t) for t in range(steps + 1)] == [
    official_lr(t) for t in range(steps + 1)
  ]
  q = schedules.QSR(
    lr,
    total_steps=steps,
    alpha=alpha,
    h_base=h_base,
    gamma=gamma,
    warmup_steps=warmup,
  )
  official = _official_sync_steps(
    official_lr, steps, alpha, gamma, h_base, h_base, warmup
  )
  assert q.sync_steps(steps) == official
  assert [t for t in range(1, steps + 1) if q.is_sync_step(t)] == official


def test_qsr_step_decay_gives_the_official_1169_syncs():
  # Step decay x0.1 at 1000 and 1500, alpha 0.02, H_base 1. After the first
  # decay the official LR is 0.1 * 0.1 ** 1 = 0.010000000000000002, so
  # (alpha / lr) ** 2 = 3.9999999999999982 and H = 3, not 4 (1127 syncs).
  from experiments import config_lib

  config = _lr_config(
    "step", steps=2000, learning_rate=0.1, lr_decay_steps=(1000, 1500)
  )
  q = schedules.QSR(
    config_lib.learning_rate(config_lib.parse(config)).float64(),
    total_steps=2000,
    alpha=0.02,
    h_base=1,
  )
  syncs = q.sync_steps(2000)
  assert len(syncs) == 1169
  assert q.period(1000) == 3 and q.period(1500) == 399
  # optax's piecewise-constant schedule, run in float64, agrees.
  optax_lr = optax.piecewise_constant_schedule(0.1, {1000: 0.1, 1500: 0.1})
  assert (
    schedules.QSR(optax_lr, total_steps=2000, alpha=0.02, h_base=1).sync_steps(
      2000
    )
    == syncs
  )


def test_qsr_refuses_a_learning_rate_below_float64():
  as_float32 = lambda t: np.float32(0.1)
  with pytest.raises(
    ValueError,
    match="QSR reads the learning rate in "
    "float64; the learning rate at step 0 is",
  ):
    schedules.QSR(as_float32, total_steps=10, alpha=0.1, h_base=1)
  cast = lambda t: jnp.asarray(0.1, jnp.float32)
  with pytest.raises(ValueError, match="float32"):
    schedules.QSR(cast, total_steps=10, alpha=0.1, h_base=1)
  with pytest.raises(ValueError, match="step 0 is nan, not finite"):
    schedules.QSR(math.nan, total_steps=10, alpha=0.1, h_base=1)
  # alpha = 0 never reads the LR; a float32 constant is then harmless.
  assert schedules.QSR(
    np.float32(0.1), total_steps=4, alpha=0.0, h_base=2
  ).sync_steps(4) == [2, 4]


@pytest.mark.parametrize(
  "kind", ["constant", "cosine", "linear", "step", "cosine_step"]
)
@pytest.mark.parametrize("warmup", [0, 20])
def test_training_and_qsr_learning_rates_are_one_schedule(kind, warmup):
  from experiments import config_lib

  config = _lr_config(
    kind,
    steps=200,
    learning_rate=0.3,
    warmup_steps=warmup,
    final_learning_rate=1e-3,
    lr_decay_steps=(60, 120),
  )
  schedule = config_lib.learning_rate(config_lib.parse(config))
  train, lr = schedule.optax(), schedule.float64()
  counts = np.arange(221)  # past the end: the LR holds its last value
  got = (
    np.full(counts.shape, train)
    if kind == "constant"
    else np.asarray(train(jnp.asarray(counts)))
  )
  want = np.array([lr(int(t)) for t in counts])
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * 0.3)
  if kind != "constant":
    assert lr(0) == (1e-3 if warmup else 0.25 if kind == "cosine_step" else 0.3)
    assert lr(200) == pytest.approx(
      {"cosine": 1e-3, "linear": 1e-3, "step": 3e-3, "cosine_step": 2.0**-10}[
        kind
      ]
    )


@pytest.mark.parametrize(
  "fields,message,parsed",
  [
    (
      dict(lr_schedule="exp"),
      "unknown lr_schedule 'exp'; valid: constant, "
      "cosine, linear, step, cosine_step",
      None,
    ),
    (dict(lr_schedule="step"), "lr_schedule=step needs lr_decay_steps", None),
    (dict(lr_schedule="step", lr_decay_steps=(50, 20)), "increasing", None),
    (
      dict(lr_schedule="step", lr_decay_steps=(20,), lr_decay_factor=0.0),
      "lr_decay_factor must be > 0",
      # The config's field check comes first.
      "config.lr_decay_factor must be a finite number > 0, got 0.0",
    ),
    (
      dict(lr_schedule="cosine_step", final_learning_rate=0.0),
      "needs learning_rate and final_learning_rate > 0",
      None,
    ),
    (
      dict(
        lr_schedule="cosine_step", final_learning_rate=1e-3, lr_round_base=1.0
      ),
      "lr_round_base must be > 0 and != 1",
      "config.lr_round_base must be a finite number > 0 and != 1, got 1.0",
    ),
    (
      dict(lr_schedule="linear", warmup_steps=100),
      "warmup_steps < steps",
      None,
    ),
  ],
)
def test_learning_rate_config_errors_name_the_problem(fields, message, parsed):
  from experiments import config_lib

  config = _lr_config("constant", steps=100, learning_rate=0.1)
  job = config_lib.parse(config)
  config.update(fields)
  # What the user is told: the config's one parse refuses it.
  with pytest.raises(ValueError, match=re.escape(parsed or message)):
    config_lib.parse(config)
  # The schedule itself (training's and QSR's twin are one object).
  with pytest.raises(ValueError, match=re.escape(message)):
    config_lib.learning_rate(job.replace(**fields))
