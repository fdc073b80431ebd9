"""Tests for the synchronization schedules (qsync_jax.parallel.schedules).

Steps are 1-based: ``is_sync_step(t)`` is asked after the t-th update, and
the QSR period chosen after ``s`` completed steps reads ``lr_schedule(s)``,
the learning rate of the next update (optax count ``s``).
"""

import json
import math

import optax
import pytest

from qsync_jax.parallel import schedules


def cosine_lr():
  """Linear warmup 0 -> 0.1 over 10 steps, cosine to 0.001 at step 100."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=0.1, warmup_steps=10, decay_steps=100,
      end_value=0.001)


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
      2, 4, 8]


def test_qsr_constant_and_degenerate_learning_rates():
  # alpha = 0 keeps init_h, still capped so training ends with an average.
  q = schedules.QSR(0.1, total_steps=10, alpha=0.0, h_base=4)
  assert q.sync_steps(10) == [4, 8, 10]
  # A zero or vanishing LR gives the remaining steps, without overflow.
  assert schedules.QSR(0.0, total_steps=10, alpha=1.0, h_base=1).period(3) == 7
  assert schedules.QSR(1e-300, total_steps=10, alpha=1e10, h_base=1,
                       gamma=3).period(0) == 10
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
      4, 8, 10]
  assert not s.averages_gradients_at(4) and not s.is_sync_step(0)
  with pytest.raises(ValueError, match="h must be a positive integer"):
    schedules.ConstantLocalSGD(0)


def test_post_local_sgd():
  s = schedules.PostLocalSGD(switch_step=5, h=3, total_steps=12)
  assert s.sync_steps(12) == [1, 2, 3, 4, 5, 8, 11, 12]
  assert [s.averages_gradients_at(t) for t in (1, 5, 6, 8)] == [
      True, True, False, False]
  with pytest.raises(ValueError, match="switch_step"):
    schedules.PostLocalSGD(switch_step=-1, h=2)


@pytest.mark.parametrize("schedule", [
    schedules.EveryStep(), schedules.ConstantLocalSGD(3, total_steps=20),
    schedules.PostLocalSGD(4, 5), schedules.PostLocalSGD(0, 2, total_steps=19)],
                         ids=lambda s: s.name)
def test_stateless_schedules_agree_and_resume_from_anything(schedule):
  assert schedule.sync_steps(20) == [t for t in range(1, 21)
                                     if schedule.is_sync_step(t)]
  assert schedule.state_dict() == {}
  schedule.load_state_dict({"h": 4, "next_sync": 8})  # e.g. from a QSR run
  assert schedule.sync_steps(20) == [t for t in range(1, 21)
                                     if schedule.is_sync_step(t)]


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
      COSINE_SYNCS)
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
      post.sync_steps(12))
  assert schedules.EveryStep().round_length(7) == 1


def test_make_schedule_builds_each_rule_and_rejects_bad_ones():
  lr = cosine_lr()
  q = schedules.make_schedule("qsr", total_steps=100, lr_schedule=lr, h_base=2,
                              alpha=0.2, warmup_steps=10)
  assert q.sync_steps(100) == COSINE_SYNCS and q.name == "qsr"
  assert schedules.make_schedule("qsr", total_steps=100, lr_schedule=lr,
                                 alpha=0.2, gamma=3.0).name == "qsr_cubic"
  assert schedules.make_schedule("local", total_steps=10,
                                 h_base=4).sync_steps(10) == [4, 8, 10]
  assert schedules.make_schedule("postlocal", total_steps=10, h_base=4,
                                 switch_step=2).sync_steps(10) == [1, 2, 6, 10]
  assert schedules.make_schedule("dp", total_steps=3).sync_steps(3) == [1, 2, 3]
  with pytest.raises(ValueError, match="alpha > 0"):
    schedules.make_schedule("qsr", total_steps=10, lr_schedule=lr)
  with pytest.raises(ValueError, match="needs the learning-rate"):
    schedules.make_schedule("qsr", total_steps=10, alpha=0.1)
  with pytest.raises(ValueError, match="unknown sync schedule 'ring'"):
    schedules.make_schedule("ring", total_steps=10)
