"""Private training: the optimizer that releases each step, the loop contract it checks, which examples
each step sees, and how the ranks of a distributed job share a step.

Where things are:

* ``optimizer.py``: ``DPOptimizer``: clip what is waiting, check the release, add noise, record, step.
  Its parts: ``optimizer_arguments.py`` (constructor checks), ``release_checks.py`` (what one step may
  release), ``parameter_sync.py`` (freezing/unfreezing), ``loss_scaling.py`` (fp16 GradScaler),
  ``optimizer_state.py`` (state_dict / load_state_dict), ``canary_slot.py`` (the protocol of an audit's
  canaries, the one component that adds to the clipped sums before the noise; implemented in ``auditing/``).
* ``schedules.py``: noise-multiplier and clip-norm schedules (torch-LR-scheduler-like ``step()``; Opacus's
  scheduler names) and the checks behind ``DPOptimizer``'s ``noise_multiplier`` / ``max_grad_norm`` setters.
* ``step_contract.py``: the loop contract (which batch each forward ran on, what a step releases); the
  ticket each drawn batch carries on its tensors is ``privacy_engine.batches.tickets``.
* ``virtual_steps.py``: ``VirtualSteps``: one logical batch in micro-batches.
* ``sampling.py``: the private batch samplers (Poisson, cyclic Poisson with optional truncation).
* ``data_loader.py``: ``DPDataLoader``, a DataLoader that draws its batches with those samplers.
* ``user_sampling.py``: user-level sampling (``privacy_unit="user"``): Poisson sampling over users, ``k``
  examples per sampled user, each batch's ticket saying which rows are one user's.
* ``distributed.py``: private data-parallel training on ``torch.distributed`` (model wrappers,
  ``make_private``'s cross-rank wiring, sampling checkpoints).
* ``distributed_job.py``: one rank's view of the job: its process group, timeouts and collectives.
* ``distributed_noise.py``: ``RankZeroNoise``, the noise of a global step (drawn on rank 0, then reduced).
* ``distributed_sampling.py``: each rank's part of one global (cyclic) Poisson sample.
* ``fsdp.py``: FSDP2 (``fully_shard``) models: ghost clipping in two backward passes, the clipped sum
  reduce-scattered by FSDP, noise on each rank's shard (``make_private`` builds them; usable by hand).
* ``fsdp_private.py``: ``FSDPPrivateOptimizer``, what ``make_private`` returns for a ``fully_shard`` model, so
  that the loop is the ordinary one (per-example losses recovered from the model's outputs).
* ``fsdp_noise.py``: ``ShardMechanismNoise``, correlated noise (BandMF, BLT) run on each rank's shard.
* ``rewrap.py``: a private loader given to ``make_private`` again, turned back into the plain loader it stands for.
"""
