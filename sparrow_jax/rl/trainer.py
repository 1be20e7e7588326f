"""The GRPO training loop: sparse rollouts, dense recomputation (docs/design.md, section 7).

One step: rollout (sparse actor) -> rewards -> group advantages -> dense recompute (LoRA off)
[and the KL term's reference log-probs] -> mismatch metrics -> GRPO update -> [closed loop: the
budget table follows the step's tail of alpha, :mod:`sparrow_jax.rl.closed_loop`] -> metrics ->
checkpoint. Steps are 0-based; the checkpoint named s holds the state before step s (s steps
done), so ``--resume`` continues at step s and reproduces an uninterrupted run bit for bit (every
random choice flows from the saved key and iterator state; evaluation draws from its own key, a
function of the seed and the step, so the evaluation cadence changes no training result).

A run folder holds one run (:mod:`sparrow_jax.rl.run_dir`); SIGINT and SIGTERM stop at the next
safe point with a checkpoint (:mod:`sparrow_jax.rl.interrupt`).

The rollout is a function ``rollout_fn(model, prompts, key, n, **extra) -> Rollout`` (the n
samples of a prompt in adjacent rows); by default it is
:func:`sparrow_jax.rollout.engine.generate` with the config's sampling settings and budget
schedule. ``extra`` is empty on one device; on a mesh it holds ``mesh`` (the devices to sample
on), and with several processes ``prompt_ids`` (the prompts' indices in the step's batch, which
fix their random streams).

Scale-out (docs/design.md, section 10): with ``config.mesh`` the policy is loaded sharded, the
optimizer state built in its layout, and the rollout, recompute and update run on the mesh.
With several processes (:mod:`sparrow_jax.distributed`) every process draws the same batch of
prompts, samples and scores its contiguous share of them on its own devices, and the rows are
gathered in process order, so each process holds the whole batch and the recompute and update
run as one program over the global mesh. The result equals one process's: the batch, the
streams (global prompt ids) and the row order do not depend on the split. Only process 0
writes the run folder's logs, metrics and config; every process writes its checkpoint shards.
A stop signal is agreed on at the step's safe points, so all processes stop at the same step.

DistillSparse (``config.distill``, docs/design.md, section 8): the policy gets LoRA adapters at
init (seeded from the run's seed), rollouts run with them on (the sparse actor), the recompute
and GRPO update with them off, unchanged. After the GRPO update the adapters take their own
AdamW steps on the same rollout batch, with the student built from the dense weights as they
were before the GRPO step (a reference kept across it: one extra copy of the dense weights while
the update runs), so the student is the actor that sampled the batch and ``logp_dense`` (the
recompute, fused rows included) comes from those same weights. The adapters and their optimizer
state are checkpointed with the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax import distributed, sharding
from sparrow_jax.config import ConfigError, to_dict
from sparrow_jax.data import PromptIterator, build_eval_sets, build_prompt_sets, evaluate_mean_at_k
from sparrow_jax.dry_run import check_device_memory
from sparrow_jax.rl import closed_loop
from sparrow_jax.rl.advantages import group_advantages
from sparrow_jax.rl.config import ModelSpec, TrainConfig, build_schedule
from sparrow_jax.rl.distill import DistillBatch, DistillUpdater, SparseRule
from sparrow_jax.rl.interrupt import StepAbandoned, StopSignals, TrainingInterrupted
from sparrow_jax.rl.recompute import DenseStats, merge_rows, recompute, reference_policy
from sparrow_jax.rl.evaluation import evaluate_held_out
from sparrow_jax.rl.rewards import get_reward, score_batch_with_metrics
from sparrow_jax.rl.run_dir import RunDirError, check_resume, prepare_fresh
from sparrow_jax.rl.step_metrics import Timer, step_metrics
from sparrow_jax.rl.update import PolicyUpdater, UpdateBatch
from sparrow_jax.rl.watchdog import StepWatchdog
from sparrow_jax.rollout.types import Rollout

RolloutFn = Callable[[Any, list[list[int]], jax.Array, int], Rollout]


# ------------------------------------------------------------------------------ building blocks
def load_policy(spec: ModelSpec, mesh: jax.sharding.Mesh | None = None):
    """-> (model with float32 master weights, ModelConfig); laid out on ``mesh`` by the
    partition rules when given (an HF folder read straight into that layout)."""
    name = spec.dtype
    if name == "auto":
        name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]
    if spec.path is not None:
        from sparrow_jax.models.hf_io import load_qwen3

        if mesh is None:
            return load_qwen3(spec.path, dtype=dtype, param_dtype=jnp.float32)
        return load_qwen3(spec.path, dtype=dtype, param_dtype=jnp.float32, mesh=mesh)
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.qwen3 import init_model

    cfg = (ModelConfig.preset(spec.preset) if spec.preset is not None
           else ModelConfig.from_hf_dict(spec.hf_config))
    model = init_model(cfg, seed=spec.seed, dtype=dtype)
    if mesh is not None:
        # Host copies first: every process holds the same values, and only host arrays may
        # be placed onto devices of other processes.
        nnx.update(model, jax.tree.map(np.asarray, nnx.state(model)))
        sharding.shard_model(model, mesh)
    return model, cfg


def engine_rollout_fn(config: TrainConfig, schedule) -> RolloutFn:
    """The sparse rollout engine with the config's temperature-only sampling
    (:meth:`RolloutSettings.rollout_config`), static or, with ``rollout.refill_slots``,
    continuous refill; with ``distill`` on, the actor's LoRA on.
    ``schedule=`` overrides ``schedule`` per call (the closed loop's current table), and
    ``schedule_bound=`` declares a ceiling of all of them (one compilation for every table)."""
    from sparrow_jax.rollout.engine import generate

    lora = config.distill.enabled
    slots = config.rollout.refill_slots
    if slots is not None:
        from sparrow_jax.rollout.refill import generate_refill

    def rollout_fn(model, prompts, key, n, schedule=schedule, schedule_bound=None, **extra):
        cfg = config.rollout.rollout_config(n, model.config.eos_token_ids)
        if slots is not None:
            return generate_refill(model, prompts, cfg, key, schedule, slots=slots, lora=lora,
                                   schedule_bound=schedule_bound,
                                   tail_slots=config.rollout.refill_tail_slots, **extra)
        return generate(model, prompts, cfg, key, schedule=schedule, lora=lora,
                        schedule_bound=schedule_bound, **extra)

    return rollout_fn


def _pooled(metrics: dict[str, float]) -> dict[str, float]:
    """A reward's batch metrics over every process: counts summed, ``*_frac`` averaged (each
    process scores the same number of rows)."""
    if not metrics:
        return metrics
    names = sorted(metrics)
    rows = distributed.allgather_rows(np.asarray([[metrics[m] for m in names]], np.float64))
    return {m: float(rows[:, i].mean() if m.endswith("_frac") else rows[:, i].sum())
            for i, m in enumerate(names)}


def responses_of(rollout: Rollout) -> list[list[int]]:
    tokens = np.asarray(rollout.tokens)
    p, n = np.asarray(rollout.prompt_lengths), np.asarray(rollout.response_lengths)
    return [tokens[b, p[b]:p[b] + n[b]].tolist() for b in range(tokens.shape[0])]


def check_rollout(rollout: Rollout, num_prompts: int, n: int) -> None:
    s = rollout.tokens.shape[0]
    if s != num_prompts * n:
        raise ValueError(f"rollout has {s} rows, expected {num_prompts} prompts x {n} samples")
    expected = np.repeat(np.arange(num_prompts), n)
    if not np.array_equal(np.asarray(rollout.prompt_index), expected):
        raise ValueError("rollout rows are not grouped as n adjacent samples per prompt "
                         "(prompt_index must be 0,0,..,1,1,..)")


def gather_rollout(local: Rollout, num_prompts: int, n: int) -> Rollout:
    """Every process's rollout of its share of the prompts -> the whole step's rollout as host
    arrays, rows in process order (one process: ``local`` as it is). Token rows are padded to
    the widest process's; past each row's prompt and response nothing is read."""
    if jax.process_count() == 1:
        return local
    width = distributed.max_over_processes(local.tokens.shape[1])
    fields = {}
    for name in (f.name for f in dataclasses.fields(Rollout)):
        x = np.asarray(getattr(local, name))
        if name == "tokens":
            x = np.pad(x, [(0, 0), (0, width - x.shape[1])])
        fields[name] = distributed.allgather_rows(x)
    fields["prompt_index"] = np.repeat(np.arange(num_prompts, dtype=np.int32), n)
    return Rollout(**fields)


def process_share(num_prompts: int) -> slice:
    """This process's contiguous share of a step's prompts."""
    k = num_prompts // jax.process_count()
    return slice(jax.process_index() * k, (jax.process_index() + 1) * k)


class TrainResult(NamedTuple):
    model: Any
    history: list[dict[str, float]]


# ------------------------------------------------------------------------------ the loop
class Trainer:
    def __init__(self, config: TrainConfig, rollout_fn: RolloutFn | None = None):
        self.config = config
        self.processes = jax.process_count()
        if config.data.prompts_per_step % self.processes:
            raise ConfigError(f"data.prompts_per_step={config.data.prompts_per_step} does not "
                              f"split over {self.processes} processes")
        self.mesh = _mesh(config, self.processes)
        slots, rollout_mesh = config.rollout.refill_slots, self._rollout_mesh()
        if slots is not None and rollout_mesh is not None:
            shards = rollout_mesh.shape["data"] * rollout_mesh.shape["fsdp"]
            if slots % shards:
                raise ConfigError(f"rollout.refill_slots={slots} does not split over the "
                                  f"{shards} row shards (data x fsdp) rollouts sample on")
            tail = config.rollout.refill_tail_slots
            if tail is not None and tail % shards:
                raise ConfigError(f"rollout.refill_tail_slots={tail} does not split over the "
                                  f"{shards} row shards (data x fsdp) rollouts sample on")
        check_device_memory(config, jax.local_devices(), jax.device_count(),
                            engine=rollout_fn is None)
        self.model, self.model_config = load_policy(config.model, self.mesh)
        # The KL term's reference: the initial weights, rebuilt from config.model on resume.
        self.reference = (reference_policy(self.model) if config.update.loss.kl_coef
                          else None)
        self.distill = self.distill_state = None
        if config.distill.enabled:
            self._attach_distill()
        self.schedule = config.budget_schedule
        # The closed-loop schedule (docs/design.md, section 9): its state, or None when off.
        self.loop = closed_loop.init_state(self.schedule.table, config.closed_loop) \
            if config.closed_loop.enabled else None
        self.rollout_fn = rollout_fn or engine_rollout_fn(config, self.schedule)
        self.reward_fn = get_reward(config.reward)
        tokenizer = None
        if config.model.path is not None and (Path(config.model.path) / "tokenizer.json").exists():
            from sparrow_jax.models.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(config.model.path)
        if config.data.task is None and tokenizer is None:
            raise ConfigError("prompt files need a model `path` holding tokenizer.json")
        self.reward_context = dict(config.reward_options, tokenizer=tokenizer,
                                   eos_ids=tuple(self.model_config.eos_token_ids))
        self.train_set, self.eval_set = build_prompt_sets(config.data, tokenizer)
        # The math recipe's held-out sets, each scored on its own (Mean@k, pass@k).
        self.eval_sets = build_eval_sets(config.data, tokenizer) if config.data.eval_sets else {}
        self.iterator = PromptIterator(len(self.train_set.prompts), config.data.prompts_per_step,
                                       config.data.seed)
        self.updater = PolicyUpdater(config.update, config.optim)
        self.opt_state = self.updater.init(self.model)
        self.key = jax.random.key(config.seed)
        self.step = 0
        run_dir = Path(config.run_dir)
        from sparrow_jax.checkpoint import Checkpointer

        self.checkpointer = Checkpointer(run_dir / "checkpoints", keep=config.keep_checkpoints)
        self.stop = StopSignals()

    def _attach_distill(self) -> None:
        """LoRA adapters on the policy and their optimizer (docs/design.md, section 8)."""
        from sparrow_jax.models.lora import LoRAParam, attach_lora

        cfg = self.config
        attach_lora(self.model, cfg.distill.lora,
                    jax.random.fold_in(jax.random.key(cfg.seed), _LORA_STREAM))
        if self.mesh is not None:
            # The adapters by their base kernels' rows of sharding.PARAM_RULES; host copies
            # first, as in load_policy.
            nnx.update(self.model, jax.tree.map(np.asarray, nnx.state(self.model, LoRAParam)))
            sharding.shard_model(self.model, self.mesh)
        self.distill = DistillUpdater(cfg.distill, cfg.update, cfg.optim,
                                      SparseRule.of(cfg.rollout.engine))
        self.distill_state = self.distill.init(self.model)

    # -- checkpoints -------------------------------------------------------------------------
    def _arrays(self):
        key = jax.random.key_data(self.key)
        if self.mesh is not None:
            # Every process holds the same key; on the mesh it is one (replicated) global array
            # that orbax writes once and restores onto any mesh.
            key = jax.device_put(np.asarray(key), jax.sharding.NamedSharding(
                self.mesh, jax.sharding.PartitionSpec()))
        # params holds the LoRA adapters too (LoRAParam is an nnx.Param).
        arrays = {"params": nnx.state(self.model, nnx.Param), "opt_state": self.opt_state,
                  "key": key}
        if self.distill is not None:
            arrays["distill_opt_state"] = self.distill_state
        return arrays

    def save(self) -> None:
        record = {"step": self.step, "data": self.iterator.state_dict(),
                  "schedule": None if self.schedule is None else self.schedule.to_dict(),
                  "closed_loop": None if self.loop is None else self.loop.to_dict(),
                  "config": to_dict(self.config)}
        self.checkpointer.save(self.step, self._arrays(), record)

    def restore(self, step: int | None = None) -> None:
        step = self.checkpointer.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {self.checkpointer.directory}")
        arrays, record = self.checkpointer.restore(step, self._arrays())
        if self.mesh is None:
            # Orbax hands back arrays committed to their device, a fresh run's are not, and jit
            # compiles anew for each: uncommitted copies keep a resumed run on the same programs.
            arrays = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), arrays)
        nnx.update(self.model, arrays["params"])
        self.opt_state = arrays["opt_state"]
        if self.distill is not None:
            self.distill_state = arrays["distill_opt_state"]
        key = arrays["key"]
        if self.mesh is not None:
            key = jnp.asarray(np.asarray(key.addressable_data(0)))
        self.key = jax.random.wrap_key_data(key)
        self.iterator.load_state_dict(record["data"])
        if record["schedule"] is not None:
            self.schedule = build_schedule(record["schedule"])
        if self.loop is not None:
            self.loop = closed_loop.ControllerState.from_dict(record["closed_loop"])
        self.step = int(record["step"])

    # -- rollouts and stops on several processes -----------------------------------------------
    def _rollout(self, prompts, key, n, prompt_ids=None, dense=False) -> Rollout:
        """``rollout_fn`` on this process's devices: the whole mesh with one process; with
        several, a copy of the weights on the local devices (each process samples its own
        prompts, ``prompt_ids`` fixing their streams). With the closed loop on, also the current
        ``schedule`` and its ``schedule_bound`` (the controller's upper bounds); ``dense``: no
        schedule (dense attention)."""
        extra = {} if self.loop is None else {
            "schedule": self.schedule,
            "schedule_bound": closed_loop.bound(self.loop, self.schedule)}
        if dense:
            extra = {"schedule": None}
        if self.mesh is None:
            return self.rollout_fn(self.model, prompts, key, n, **extra)
        if self.processes == 1:
            return self.rollout_fn(self.model, prompts, key, n, mesh=self.mesh, **extra)
        model, mesh = self._local_policy()
        if prompt_ids is not None:
            extra["prompt_ids"] = prompt_ids
        if mesh is not None:
            extra["mesh"] = mesh
        return self.rollout_fn(model, prompts, key, n, **extra)

    def _local_policy(self):
        """-> (the policy's decode copy on this process's devices: in the compute dtype, laid
        out on the mesh of its local devices as the rollout's (split over ``tensor``); or
        whole on its one device, the mesh None). The local arrays are the shards of one
        cast-and-gather over the run's mesh into that layout (``model_params`` takes them as
        they are): no float32 whole copy, and no ``jax.device_put`` from one device onto the
        others (seconds a call)."""
        from sparrow_jax.rollout.engine import to_compute_dtype

        graphdef, state = nnx.split(self.model)
        cast = to_compute_dtype(jnp.dtype(self.model.dtype))
        mesh = self._rollout_mesh()
        # The run's tensor axis where the local mesh splits over it too, else whole copies.
        specs = sharding.rollout_specs(state, 1 if mesh is None else mesh.shape["tensor"])
        copy = jax.jit(lambda s: jax.tree.map(cast, s), out_shardings=jax.tree.map(
            lambda spec: jax.sharding.NamedSharding(self.mesh, spec), specs,
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))(state)
        local = jax.tree.map(lambda x, spec: x.addressable_data(0) if mesh is None
                             else sharding.local_shards(x, mesh, spec), copy, specs,
                             is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        return nnx.merge(graphdef, local), mesh

    def _rollout_mesh(self):
        """The mesh rollouts sample on: the run's, with one process; with several, one of this
        process's own devices (None when it has one)."""
        if self.processes == 1:
            return self.mesh
        devices = jax.local_devices()
        if len(devices) == 1:
            return None
        tensor = self.mesh.shape["tensor"]
        return sharding.make_mesh(sharding.MeshConfig(
            data=1, fsdp=-1, tensor=tensor if len(devices) % tensor == 0 else 1), devices)

    def _abandonable(self):
        """Signals abandon the phase at once with one process; with several, a process must
        not leave the others waiting in a collective, so the stop is agreed on at the phase's
        end (:meth:`_agreed_stop`)."""
        return self.stop.abandonable() if self.processes == 1 else contextlib.nullcontext()

    def _agreed_stop(self) -> bool:
        """Whether any process has a stop signal (the same answer on all; a collective with
        several processes). A process that got none adopts SIGTERM, so that all save and stop
        alike."""
        if self.processes == 1:
            return self.stop.signum is not None
        if distributed.any_process(self.stop.signum is not None):
            if self.stop.signum is None:
                self.stop.signum = signal.SIGTERM
            return True
        return False

    # -- one step ----------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One GRPO step. Everything before the update is abandonable (:mod:`interrupt`): it
        changes no state but the key and the prompt iterator, which :meth:`run` puts back."""
        cfg = self.config
        n, temperature = cfg.rollout.samples_per_prompt, cfg.rollout.temperature
        timer = Timer()
        with self._abandonable():
            prompts, answers = self.iterator.next_batch(self.train_set)
            self.key, k_roll, k_update = jax.random.split(self.key, 3)
            share = process_share(len(prompts)) if self.processes > 1 else slice(None)
            mine = np.arange(len(prompts))[share]
            with timer("rollout"):
                rollout = jax.block_until_ready(self._rollout(
                    prompts[share], k_roll, n, prompt_ids=mine if self.processes > 1 else None))
            check_rollout(rollout, len(mine), n)
            rewards, reward_metrics = score_batch_with_metrics(
                self.reward_fn, [p for p in prompts[share] for _ in range(n)],
                responses_of(rollout), [a for a in answers[share] for _ in range(n)],
                **self.reward_context)
            if self.processes > 1:
                if self._agreed_stop():
                    raise StepAbandoned()
                rollout = gather_rollout(rollout, len(prompts), n)
                rewards = distributed.allgather_rows(np.asarray(rewards, np.float64))
                reward_metrics = _pooled(reward_metrics)
            advantages = np.asarray(group_advantages(np.asarray(rewards), n))

            u = cfg.update
            plan = self.updater.plan(k_update, len(rewards))
            # The first mini-batch's forward doubles as its rows' recompute (update.py).
            fused_rows = plan[0][0] if u.fuse_recompute else np.zeros(0, np.int64)
            with timer("recompute"):
                dense = recompute(self.model, rollout, temperature,
                                  rows=np.setdiff1d(np.arange(len(rewards)), fused_rows),
                                  micro_batch_size=u.micro_batch_size, top_k=cfg.mismatch.top_k,
                                  chunk_size=u.chunk_size, length_multiple=u.length_multiple)
            logp_ref = None
            if self.reference is not None:
                with timer("reference"):
                    logp_ref = recompute(self.reference, rollout, temperature,
                                         micro_batch_size=u.micro_batch_size, top_k=1,
                                         chunk_size=u.chunk_size,
                                         length_multiple=u.length_multiple).logprobs

        # The dense weights that sampled this batch, for the LoRA update after the GRPO step.
        before = nnx.clone(self.model) if self.distill is not None else None
        with timer("update"):
            batch = UpdateBatch(np.asarray(rollout.tokens), np.asarray(rollout.prompt_lengths),
                                np.asarray(rollout.response_lengths), dense.logprobs,
                                np.asarray(rollout.logprobs), advantages.astype(np.float32),
                                np.asarray(rollout.topk_ids), logp_ref)
            self.opt_state, update_metrics, fused = self.updater.update(
                self.model, self.opt_state, batch, plan, temperature, self.step,
                fuse_top_k=cfg.mismatch.top_k if u.fuse_recompute else 0)
        if fused is not None:
            dense = merge_rows(dense, fused, fused_rows)
        if self.distill is not None:
            update_metrics.update(self._distill_step(before, rollout, dense, advantages, plan,
                                                     timer))
        if self.loop is not None:
            self.loop, self.schedule, loop_metrics = closed_loop.observe(
                self.loop, cfg.closed_loop, self.schedule, rollout, dense)
            update_metrics.update(loop_metrics)
        self.step += 1
        return {**step_metrics(cfg, rollout, dense, rewards, update_metrics, timer.seconds),
                **reward_metrics}

    def _distill_step(self, student, rollout: Rollout, dense: DenseStats, advantages, plan,
                      timer) -> dict[str, float]:
        """The LoRA update on ``student`` (this step's pre-update dense weights, adapters as they
        sampled the batch), copied into the policy; every ``distill.eval_every`` steps also the
        alpha of the same rollout under the actor without its LoRA."""
        from sparrow_jax.models.lora import LoRAParam

        cfg = self.config
        temperature = cfg.rollout.temperature
        out = {}
        every = cfg.distill.eval_every
        if every and self.step % every == 0:
            from sparrow_jax.rl.distill_eval import alpha_without_lora

            with timer("distill_eval"):
                out.update(alpha_without_lora(student, rollout, dense, temperature,
                                              self.distill.rule, cfg.update))
        with timer("distill"):
            batch = DistillBatch.of(rollout, dense.logprobs, advantages)
            self.distill_state, metrics = self.distill.update(
                student, self.distill_state, batch, plan, temperature, self.step)
            nnx.update(self.model, nnx.state(student, LoRAParam))
        return {**metrics, **out}

    def evaluate(self, step: int) -> dict[str, float]:
        """mean@k and best@k on the held-out prompts, after ``step``; with ``data.eval_sets``,
        Mean@k and pass@k of each set sampled at the rollout's schedule and dense
        (:func:`~sparrow_jax.rl.evaluation.evaluate_held_out`). Its random stream is its own
        (seed, step), never the training key."""
        k = self.config.eval_samples
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.config.seed),
                                                    _EVAL_STREAM), step)

        def sampler(dense):
            def sample_fn(prompts, k_):
                nonlocal key
                key, sub = jax.random.split(key)
                return responses_of(self._rollout(prompts, sub, k_, dense=dense))
            return sample_fn

        if self.eval_sets:
            samplers = {"sparse": sampler(False), "dense": sampler(True)}
            if self.schedule is None:
                del samplers["sparse"]
            score = functools.partial(score_batch_with_metrics, self.reward_fn,
                                      **self.reward_context)
            return evaluate_held_out(samplers, self.eval_sets, score, k,
                                     batch_size=self.config.data.prompts_per_step)
        sample_fn = sampler(False)

        def reward(p, r, a):
            return self.reward_fn(p, r, a, **self.reward_context)

        res = evaluate_mean_at_k(sample_fn, self.eval_set, reward, k,
                                 batch_size=self.config.data.prompts_per_step)
        return {"eval_mean_at_k": res["mean_at_k"], "eval_best_at_k": res["best_at_k"]}

    def run(self, resume: bool = False) -> TrainResult:
        """Steps until ``config.steps``. On SIGINT/SIGTERM: saves the state at the next safe
        point and raises :class:`~sparrow_jax.rl.interrupt.TrainingInterrupted`."""
        cfg = self.config
        if resume:
            self.restore()
        from sparrow_jax.metrics import MetricsWriter

        primary = distributed.is_primary()
        writer = MetricsWriter(cfg.run_dir, tensorboard=cfg.tensorboard,
                               resume_from=self.step if resume else None) if primary else None
        history = []
        bar = None
        if cfg.progress and primary:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step, desc="grpo", unit="step")
        watchdog = (StepWatchdog(cfg.step_timeout_s, describe=lambda: f"in step {self.step}")
                    if cfg.step_timeout_s else None)
        try:
            with self.stop, watchdog or contextlib.nullcontext():
                while self.step < cfg.steps and not self._agreed_stop():
                    metrics = self._step_or_abandon()
                    if metrics is None:
                        break
                    step = self.step - 1
                    if cfg.eval_every and self.step % cfg.eval_every == 0:
                        try:
                            with self._abandonable():
                                metrics.update(self.evaluate(step))
                        except StepAbandoned:
                            pass
                    if writer is not None:
                        writer.write(step, metrics)
                    history.append({"step": step, **metrics})
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                                        alpha=f"{metrics['alpha_paper_mean']:.3f}")
                    if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                        self.save()
                    if watchdog is not None:
                        watchdog.beat()
                if self._agreed_stop():
                    if self.checkpointer.latest_step() != self.step:
                        self.save()
                    raise TrainingInterrupted(self.stop.signum, self.step,
                                              str(self.checkpointer.directory))
        finally:
            if bar is not None:
                bar.close()
            if writer is not None:
                writer.close()
        return TrainResult(self.model, history)

    def _step_or_abandon(self) -> dict[str, float] | None:
        """:meth:`train_step`, or None when a signal abandoned it (state put back)."""
        key, data = self.key, self.iterator.state_dict()
        try:
            return self.train_step()
        except StepAbandoned:
            self.key = key
            self.iterator.load_state_dict(data)
            return None


def _mesh(config: TrainConfig, processes: int) -> jax.sharding.Mesh | None:
    """The run's mesh: ``config.mesh`` over every device of every process; None (one device) when
    it is unset and one process runs."""
    spec = config.mesh
    if spec is None and processes > 1:
        spec = sharding.MeshConfig()
    if spec is None:
        return None
    try:
        return sharding.make_mesh(spec)
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from None


_EVAL_STREAM = 0x65766131  # folded into the seed's key: evaluation's own random stream
_LORA_STREAM = 0x6c6f7261  # folded into the seed's key: the LoRA adapters' initialisation


def train(config: TrainConfig, *, resume: bool = False, overwrite: bool = False,
          rollout_fn: RolloutFn | None = None) -> TrainResult:
    """Runs GRPO for ``config.steps`` steps in ``config.run_dir`` (:func:`prepare_run` first).
    Raises :class:`~sparrow_jax.rl.interrupt.TrainingInterrupted` after saving, on
    SIGINT/SIGTERM."""
    prepare_run(config, resume=resume, overwrite=overwrite)
    return Trainer(config, rollout_fn).run(resume=resume)


def _prepare_run_once(config: TrainConfig, resume: bool, overwrite: bool) -> None:
    """:func:`prepare_run`'s work. A resume only reads, so every process checks (orbax's reads
    are collectives); a fresh run's folder is readied by process 0 alone, and the others learn
    whether it refused."""
    if jax.process_count() == 1 or resume:
        return _prepare(config, resume, overwrite)
    error = None
    if distributed.is_primary():
        try:
            _prepare(config, resume, overwrite)
        except (ConfigError, RunDirError) as e:
            error = e
    if distributed.any_process(error is not None):
        raise error or RunDirError(f"process 0 refused the run folder {config.run_dir} (its "
                                   "message says why)")


def prepare_run(config: TrainConfig, *, resume: bool = False, overwrite: bool = False) -> None:
    """Readies ``config.run_dir`` before the model loads. A fresh run refuses a folder that
    holds another run unless ``overwrite`` (which deletes that run's files) and writes the
    folder's ``config.yaml``; ``resume`` refuses when the latest checkpoint's config differs in
    what changes the results (:mod:`sparrow_jax.rl.run_dir`). With several processes
    (connected here, :func:`sparrow_jax.distributed.initialize`) process 0 does this alone."""
    distributed.initialize()
    _prepare_run_once(config, resume, overwrite)


def _prepare(config: TrainConfig, resume: bool, overwrite: bool) -> None:
    import yaml

    run_dir = Path(config.run_dir)
    if resume:
        if overwrite:
            raise ConfigError("--resume continues the run in the folder; --overwrite deletes it: "
                              "give one of them")
        _check_resumable(config)
    else:
        prepare_fresh(run_dir, overwrite)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def _check_resumable(config: TrainConfig) -> None:
    from sparrow_jax.checkpoint import Checkpointer

    directory = Path(config.run_dir) / "checkpoints"
    checkpointer = Checkpointer(directory, keep=config.keep_checkpoints) \
        if directory.is_dir() else None
    step = checkpointer and checkpointer.latest_step()
    if step is None:
        raise RunDirError(f"--resume: no checkpoint in {directory}; start the run without "
                          "--resume")
    check_resume(checkpointer.read_record(step)["config"], to_dict(config),
                 f"checkpoint {step} in {directory}")
