"""Private training of a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): fast (ghost)
clipping in two backward passes, the clipped sum reduce-scattered by FSDP itself, noise added to each
rank's shard.

``make_private`` builds these pieces for a ``fully_shard`` model (``privacy_engine.training.fsdp_private``, the
user's ordinary loop); they can also be built by hand::

    for block in model.layers: fully_shard(block)
    fully_shard(model)
    loader = distributed_data_loader(DataLoader(dataset, batch_size=expected_global_batch))
    clipping = FSDPGhostClipping(model, max_grad_norm=C)
    noise = ShardNoise(noise_multiplier=sigma, max_grad_norm=C, seed=run_seed)
    step = FSDPPrivateStep(torch.optim.AdamW(model.parameters()), noise, loader, accountant=accountant)
    for x, y in loader:
        losses = F.cross_entropy(model(x), y, reduction="none")   # one loss per example
        clipping.backward(losses)
        step.step()

What one global step does:

1. Sampling: ``distributed_data_loader`` (the DDP loader): every example belongs to one rank's shard of
   the dataset, each rank Poisson-samples its shard at the *global* rate ``q``; the union of the ranks'
   batches is one Poisson sample of the dataset.
2. Norms (first backward): forward hooks on every layer owning trainable parameters keep its inputs and
   output; ``torch.autograd.grad`` of the summed per-example losses with respect to those outputs gives
   each layer's output gradient ``G`` (FSDP's pre-backward hooks all-gather the parameters as in any
   backward; no parameter gradient is formed, so FSDP reduce-scatters nothing). The layer's norm sampler
   (``grad_samplers.registry``) turns inputs and ``G`` into per-example squared norms; only the rank
   holding an example computes its norm (norms of the unsharded weights' gradients: a linear layer's
   do not involve the weight at all).
3. Clipped sum (second backward over the same graph): ``sum_i w * f_i * loss_i`` with
   ``f = clip_factors(norms, C)`` detached and ``w`` the world size, whose gradient is ``w`` times this
   rank's clipped sum; FSDP's own reduce-scatter averages over the ``w`` ranks, so each rank's sharded
   ``.grad`` (a ``DTensor``) holds its shard of the *global* clipped sum. No collective of ours.
4. Noise (``ShardNoise``): each rank adds ``N(0, (sigma C)^2)`` to the local shard of every gradient,
   from its own stream (seeded from one run seed and the rank; secure mode: the OS). The shards are
   disjoint and cover the full vector, so the full vector is noised exactly once, with independent
   coordinates: the same mechanism as one process drawing one noise vector.
5. ``FSDPPrivateStep`` divides by the global expected batch size ``q N``, steps the optimizer, records
   one Poisson-subsampled Gaussian step (rate ``q``, ``sigma``) in the accountant: the single-process
   event.

Not supported yet: hooks/functorch modes (refused), FSDP1 (refused), a parameter shared by two layers or a
layer called twice in one forward (refused: cross terms), layers without a norm sampler (refused at
construction), float16 mixed precision (refused; bfloat16 is supported), checkpoints of the sharded state.
Correlated noise (BandMF, BLT) per shard: ``privacy_engine.training.fsdp_noise``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accountants.events import EventSpec
from grad_samplers.registry import NormSampler, norm_sampler_for, registered_layer_samplers
from privacy_engine.clipping.rule import clip_factors
from privacy_engine.noise.secure_random import full_entropy_generator
from privacy_engine.settings_checks import check_max_grad_norm
from privacy_engine.training.distributed_job import DistributedJob
from privacy_engine.training.distributed_sampling import derived_seed

__all__ = ["FSDPGhostClipping", "FSDPPrivateStep", "ShardNoise", "fsdp_problem"]

# Spawn key of the per-rank noise streams derived from the run seed (apart from the sampling key 7001).
_SHARD_NOISE_KEY = 7002


def _fsdp2_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def _fsdp1_class() -> type | None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    return FullyShardedDataParallel


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is sharded with ``fully_shard`` (FSDP2)."""
    fsdp2 = _fsdp2_class()
    return fsdp2 is not None and any(isinstance(module, fsdp2) for module in model.modules())


def fsdp_problem(model: nn.Module, grad_sample_mode: str | None) -> str | None:
    """Why ``make_private`` cannot train ``model`` as it is sharded, or None if it is not sharded.

    ============================================  ==========================================================
    model                                         result
    ============================================  ==========================================================
    not sharded                                   None
    FullyShardedDataParallel (FSDP1) anywhere     message: shard with ``fully_shard`` (FSDP2) instead
    FSDP2, "hooks", "functorch", "ew", "no_op"    message: per-example gradients are not formed on shards;
                                                  use grad_sample_mode="ghost"
    FSDP2, "ghost", "auto" or None                None: ``make_private`` builds it
                                                  (``privacy_engine.training.fsdp_private``)
    ============================================  ==========================================================
    """
    fsdp1 = _fsdp1_class()
    for path, module in model.named_modules():
        if fsdp1 is not None and isinstance(module, fsdp1):
            where = repr(path) if path else "the model"
            return (
                f"{where} is wrapped in FullyShardedDataParallel (FSDP1), which private training does not support: "
                "shard the model with FSDP2 instead (torch.distributed.fsdp.fully_shard on each block, then on the "
                "model) and train it with grad_sample_mode='ghost' (privacy_engine.training.fsdp), or wrap the "
                "unsharded model in DistributedDataParallel"
            )
    if not is_fsdp2(model):
        return None
    if grad_sample_mode not in (None, "auto", "ghost"):
        return (
            f"the model is sharded with FSDP2 (fully_shard) and grad_sample_mode={grad_sample_mode!r}: that mode "
            "forms per-example gradients of every parameter, whose unsharded copies FSDP2 frees after each layer. "
            "Use grad_sample_mode='ghost' (per-example norms in backward, the clipped sum reduce-scattered by "
            "FSDP; privacy_engine.training.fsdp), or wrap the unsharded model in DistributedDataParallel"
        )
    return None


def _norm_sampler(module: nn.Module) -> NormSampler | None:
    """The norm sampler of ``module``'s layer type; ``fully_shard`` replaces a module's class by a subclass
    ``FSDP<Layer>`` of ``FSDPModule`` and the layer, so the layer's own class is looked up."""
    sampler = norm_sampler_for(module)
    if sampler is not None:
        return sampler
    fsdp2 = _fsdp2_class()
    if fsdp2 is None or not isinstance(module, fsdp2):
        return None
    table = registered_layer_samplers()
    for base in type(module).__bases__:
        if base is not fsdp2 and base in table:
            return table[base].norm_sample
    return None


def _precision_problem(model: nn.Module) -> str | None:
    """Why the FSDP2 mixed-precision policies or parameter dtypes of ``model`` cannot be trained privately, or
    None. Allowed: parameters kept in 32 or 64 bits, computed in them or in bfloat16 (``param_dtype``), the
    gradients reduced in 32 bits or more (``reduce_dtype``)."""
    fsdp2 = _fsdp2_class()
    for path, module in model.named_modules():
        low = [name for name, p in module.named_parameters(recurse=False)
               if p.requires_grad and p.is_floating_point() and torch.finfo(p.dtype).bits < 32]  # fmt: skip
        if low:
            return (f"trainable parameters {low} of {path or 'the model'!r} are stored in 16 bits: noise added in 16 "
                    "bits loses most of its precision. Keep float32 parameters and compute in bfloat16 with "
                    "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                    "reduce_dtype=torch.float32))")  # fmt: skip
        if fsdp2 is None or not isinstance(module, fsdp2):
            continue
        # FSDP2 keeps each module's policy on its state (no public getter in torch 2.13).
        policy = getattr(getattr(module, "_get_fsdp_state", lambda: None)(), "_mp_policy", None)
        if policy is None or policy.param_dtype is None:
            continue
        where = repr(path) if path else "the model"
        if policy.param_dtype == torch.float16:
            return (f"{where} is sharded with mixed precision MixedPrecisionPolicy(param_dtype=torch.float16): "
                    "float16 gradients need loss scaling and may overflow, which per-example norms cannot "
                    "survive. Use param_dtype=torch.bfloat16 (with reduce_dtype=torch.float32)")  # fmt: skip
        reduce_dtype = policy.reduce_dtype or policy.param_dtype
        if reduce_dtype.is_floating_point and torch.finfo(reduce_dtype).bits < 32:
            return (f"{where} is sharded with mixed precision that reduces gradients in {reduce_dtype}: the clipped "
                    "sum must be reduced in float32. Add reduce_dtype=torch.float32 to its MixedPrecisionPolicy")  # fmt: skip
    return None


def _upcast(value: Any) -> Any:
    """A 16-bit floating tensor in float32 (anything else unchanged): what the norm samplers see."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and torch.finfo(value.dtype).bits < 32:
        return value.float()
    return value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself if it is not one)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class FSDPGhostClipping:
    """Per-example clipping of an FSDP2 model in two backward passes (see the module docstring).

    Guarantee: after ``backward(losses)`` on every rank, each trainable parameter's sharded ``.grad`` holds
    this rank's shard of ``sum_i f_i g_i`` over the examples of *all* ranks (added to what ``.grad``
    held), with ``g_i`` the exact gradient of example ``i``'s loss and ``f_i = min(1, C / ||g_i||)``
    from its exact norm over all parameters: each example's contribution has L2 norm at most ``C``,
    whatever the data, and is counted once (by the rank that holds it).

    ===========================================  ======================================================
    case                                         behaviour
    ===========================================  ======================================================
    model not sharded with ``fully_shard``       TypeError at construction
    a trainable parameter not a sharded DTensor  TypeError at construction (shard the whole model)
    replicated placement (HSDP), several meshes  NotImplementedError at construction
    a layer owning trainable parameters without  TypeError at construction naming it (no norm sampler)
    a norm sampler
    a parameter owned by two layers (tied)       ValueError at construction (cross terms)
    a layer called twice in one forward          RuntimeError in ``backward``, before any gradient
    a layer's output modified in place later     RuntimeError in ``backward``, before any gradient
    ``losses`` not 1-D / not one per example     ValueError in ``backward``, before any gradient
    bfloat16 compute (FSDP ``param_dtype``)      supported: norms and factors in float32/64 (below)
    float16 ``param_dtype``, 16-bit              NotImplementedError at construction
    ``reduce_dtype`` or 16-bit parameters
    float16 outputs or losses (autocast)         NotImplementedError in ``backward``, before any gradient
    norm NaN/Inf                                 factor 0: the example contributes nothing
    ``C = 0`` / ``C = inf``                      all factors 0 / no clipping (``clip_factors``)
    empty local batch                            takes part in FSDP's collectives, adds zero
    eval mode / no grad                          nothing kept
    ===========================================  ======================================================

    Mixed precision (``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``):
    the layers' activations and output gradients are upcast to float32 before the norm samplers see them,
    the squared norms are summed in float64, the factors and the weighted loss are float32, FSDP reduces the
    clipped sum in float32 into the float32 sharded gradients, and the noise is added to those in float32.
    What bfloat16 leaves: the gradients themselves are computed by autograd in bfloat16 (8-bit mantissa),
    so the norm of the contribution ``f_i g_i`` actually summed can exceed ``C`` by bfloat16 rounding of the
    backward pass (relative ~1e-2 at most for a few layers), as with any 16-bit DP training; the privacy
    analysis assumes exact arithmetic. Keep a float32 model (no policy) for the exact bound.

    Every rank must call ``backward`` once per step (FSDP's collectives pair the ranks' passes); the
    collectives wait at most the process group's timeout, so a crashed or stalled rank makes the others
    raise instead of hanging.
    """

    def __init__(self, model: nn.Module, max_grad_norm: float) -> None:
        fsdp2 = _fsdp2_class()
        if fsdp2 is None or not isinstance(model, fsdp2):
            raise TypeError(
                f"model must be the root module sharded with torch.distributed.fsdp.fully_shard (FSDP2); got "
                f"{type(model).__name__}. Call fully_shard(model) after sharding its blocks."
            )
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        precision = _precision_problem(model)
        if precision is not None:
            raise NotImplementedError(precision)
        self.model = model
        owners: dict[int, str] = {}
        meshes: set = set()
        layers: list[tuple[str, nn.Module]] = []
        for path, module in model.named_modules():
            own = [(name, p) for name, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            for name, param in own:
                label = f"{path}.{name}" if path else name
                if not hasattr(param, "placements"):
                    raise TypeError(
                        f"parameter {label!r} is not sharded (not a DTensor): call fully_shard on the model that "
                        "owns it (every trainable parameter must be under fully_shard)"
                    )
                if len(param.placements) != 1 or not param.placements[0].is_shard():
                    # A replicated dimension (HSDP) would have every replica noise the same coordinates.
                    raise NotImplementedError(
                        f"parameter {label!r} has placements {param.placements}: only a 1-D mesh with sharded "
                        "parameters (fully_shard over one mesh dimension) is supported, not HSDP / replication"
                    )
                meshes.add(param.device_mesh)
                if id(param) in owners:
                    raise ValueError(
                        f"parameter {label!r} is also owned by {owners[id(param)]!r}: a parameter shared by two "
                        "layers needs cross terms in its per-example norm, not supported under FSDP"
                    )
                owners[id(param)] = label
            if _norm_sampler(module) is None:
                raise TypeError(
                    f"layer {path or 'the root'!r} ({type(module).__name__}) owns trainable parameters but has no "
                    "norm sampler (grad_samplers.registry): its per-example norms cannot be computed under FSDP. "
                    "Freeze its parameters or register a norm sampler for its type."
                )
            layers.append((path, module))
        if not layers:
            raise ValueError("the model has no trainable parameter: nothing to clip")
        if len(meshes) != 1:
            raise NotImplementedError("the trainable parameters are sharded over different device meshes: shard the "
                                      "whole model over one mesh")  # fmt: skip
        #: The ranks FSDP's reduce-scatter averages over (the mesh's, not necessarily the default group's).
        self.world_size = int(next(iter(meshes)).size())
        self._paths = {id(module): path for path, module in layers}
        self._samplers = {id(module): _norm_sampler(module) for _, module in layers}
        self._calls: list[tuple[str, nn.Module, tuple, torch.Tensor, int]] = []
        self._handles = [module.register_forward_hook(self._keep) for _, module in layers]
        # A new training forward of the model starts a new record (one left by a forward whose backward never
        # ran is dropped, not mistaken for a second call of its layers).
        self._handles.append(model.register_forward_pre_hook(self._start_forward))
        self.last_per_sample_norms: torch.Tensor | None = None

    def _start_forward(self, module: nn.Module, args: tuple) -> None:
        if module.training and torch.is_grad_enabled():
            self._calls = []

    def _keep(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(module).__name__} returned {type(output).__name__}: a layer with a norm sampler "
                            "must return one tensor")  # fmt: skip
        path = self._paths[id(module)]
        activations = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        self._calls.append((path, module, activations, output, output._version))

    def remove(self) -> None:
        """Remove the forward hooks (the model is left as it was given)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._calls.clear()

    def backward(self, losses: torch.Tensor) -> torch.Tensor:
        """Both passes for the last training forward: ``losses`` holds one loss per example of this
        rank's batch (``reduction="none"``). Returns this rank's per-example norms (diagnostics: computed
        from the data, not private). See the class docstring for the guarantee."""
        calls, self._calls = self._calls, []
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            raise ValueError(
                "losses must be a 1-D tensor with one loss per example (the criterion with reduction='none'); got "
                f"{getattr(losses, 'shape', type(losses).__name__)}"
            )
        if not calls:
            raise RuntimeError("no training forward ran since the last backward (model in eval mode or no_grad?)")
        changed = [path for path, _, _, output, version in calls if output._version != version]
        if changed:
            # The gradient with respect to such an output would be that of the in-place op's result, not the
            # layer's: its norms would be wrong.
            raise RuntimeError(
                f"the outputs of layers {changed} were modified in place after the layer (e.g. ReLU(inplace=True)): "
                "use out-of-place operations after layers with trainable parameters under FSDP"
            )
        paths = [path for path, *_ in calls]
        repeated = sorted({p for p in paths if paths.count(p) > 1})
        if repeated:
            raise RuntimeError(
                f"layers {repeated} ran more than once in one forward: their per-example norms need cross terms "
                "between the calls, not supported under FSDP"
            )
        if any(t.dtype == torch.float16 for _, _, _, t, _ in calls) or losses.dtype == torch.float16:
            # bfloat16 (FSDP's param_dtype or autocast) is supported; float16 gradients need loss scaling.
            raise NotImplementedError(
                "layer outputs or losses in torch.float16: mixed precision in float16 is not supported under FSDP "
                "(gradients need loss scaling and may overflow); use bfloat16 "
                "(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))"
            )
        batch = losses.shape[0]
        for path, _, _, output, _ in calls:
            if output.shape[0] != batch:
                raise ValueError(f"layer {path!r} saw a batch of {output.shape[0]}; losses has {batch} entries "
                                 "(one per example, batch dimension first)")  # fmt: skip
        outputs = [output for _, _, _, output, _ in calls]
        # The gradient of the summed losses: each example's slice of G is that example's own gradient.
        output_grads = torch.autograd.grad(losses.sum(), outputs, retain_graph=True, allow_unused=True)
        squared = torch.zeros(batch, dtype=torch.float64, device=losses.device)
        for (_, module, activations, _, _), grad in zip(calls, output_grads):
            if grad is None or batch == 0:
                # The output did not reach the loss, or no example: nothing to add. (An empty batch still ran
                # the pass above: its all-gathers pair with the other ranks'.)
                continue
            # Mixed precision: the samplers see float32 copies of bfloat16 activations and output gradients.
            activations = tuple(_upcast(a) for a in activations)
            for value in self._samplers[id(module)](module, activations, _upcast(grad)).values():
                squared = squared + value.to(torch.float64)
        norms = squared.sqrt()
        # The factors and the weighted loss in float32 at least: a bfloat16 factor could exceed min(1, C/||g||)
        # by 2^-9 relative (float32 and float64 losses: unchanged).
        dtype = torch.promote_types(losses.dtype, torch.float32)
        factors = clip_factors(norms, self.max_grad_norm).to(dtype)
        # FSDP's reduce-scatter averages over the mesh's ranks; the world size in the weights makes it the global
        # sum (an exact power-of-two factor for 2 and 4 ranks).
        weighted = (factors.detach() * self.world_size * losses.to(dtype)).sum()
        weighted.backward()
        self.last_per_sample_norms = norms.detach()
        return self.last_per_sample_norms


class ShardNoise:
    """Gaussian noise of std ``noise_multiplier * max_grad_norm`` on this rank's shard of each gradient.

    Guarantee: when every rank calls ``add_(params)`` once per step on the same parameters, every
    coordinate of the full (gathered) gradient vector receives exactly one independent ``N(0, (sigma
    C)^2)`` draw: a rank only touches the local shard it owns (the shards of FSDP2 are disjoint and cover
    each parameter), and the ranks' streams are distinct (seeded from ``derived_seed(seed, key, rank)``,
    independent streams of one run seed; secure mode: four full-entropy generators from the OS, summed and
    halved, as ``GaussianNoise`` does).

    ============================  ==================================================
    case                          result
    ============================  ==================================================
    noise_multiplier = 0          nothing added
    seed None, not secure         one draw from torch's global generator (per rank)
    secure_mode and a seed        ValueError (the OS seeds it)
    noise_multiplier < 0 / NaN    ValueError
    parameter without ``.grad``   skipped (nothing released for it)
    replicated DTensor grad       NotImplementedError (replicas would noise it twice)
    ============================  ==================================================
    """

    def __init__(self, *, noise_multiplier: float, max_grad_norm: float, seed: int | None = None,
                 secure_mode: bool = False, rank: int | None = None) -> None:  # fmt: skip
        sigma = float(noise_multiplier)
        if math.isnan(sigma) or sigma < 0 or math.isinf(sigma):
            raise ValueError(f"noise_multiplier must be a finite number >= 0; got {noise_multiplier!r}")
        self.noise_multiplier = sigma
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        if secure_mode and seed is not None:
            raise ValueError("seed must be None in secure_mode (the noise generators are seeded from the OS)")
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank = int(rank)
        self.secure_mode = bool(secure_mode)
        #: What seeds the streams, compared across ranks by ``FSDPPrivateStep``.
        self.seed_fingerprint = ("secure mode",) if secure_mode else ("none",) if seed is None else ("seed", int(seed))
        if self.secure_mode:
            self._generators = [full_entropy_generator("cpu") for _ in range(4)]
        else:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,)).item())
            generator = torch.Generator()
            generator.manual_seed(derived_seed(int(seed), _SHARD_NOISE_KEY, self.rank))
            self._generators = [generator]

    def state_dict(self) -> dict[str, Any]:
        """This rank's stream position, for checkpoints (plain data). Secure mode: none (the OS's generators
        are never saved; a resume draws fresh ones)."""
        if self.secure_mode:
            return {"secure_mode": True}
        return {"secure_mode": False, "rank": self.rank, "generator": self._generators[0].get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` of the same rank: the next draws are those the saved stream would have
        made. ValueError, nothing changed, for another rank's or another mode's state."""
        if bool(state.get("secure_mode")) != self.secure_mode:
            raise ValueError(f"the noise state was saved with secure_mode={state.get('secure_mode')}; this noise has "
                             f"secure_mode={self.secure_mode}")  # fmt: skip
        if self.secure_mode:
            return
        if int(state["rank"]) != self.rank:
            raise ValueError(f"the noise state is rank {state['rank']}'s; this is rank {self.rank}: each rank loads "
                             "its own stream")  # fmt: skip
        self._generators[0].set_state(state["generator"])

    @property
    def std(self) -> float:
        """The noise's standard deviation per coordinate, ``noise_multiplier * max_grad_norm``."""
        return self.noise_multiplier * self.max_grad_norm

    def privacy_event(self) -> EventSpec:
        """DP-SGD's event (fresh iid Gaussian noise on every coordinate at every step, one band)."""
        return EventSpec()

    def settings(self) -> dict[str, Any]:
        """Plain data the ranks must agree on besides sigma, C and the seed: the mechanism (DP-SGD's)."""
        return {"mechanism": "ShardNoise"}

    def add_(self, params: list[torch.Tensor]) -> None:
        """Add this step's noise to the local shard of each parameter's ``.grad`` (in float32 or the
        gradient's dtype if wider; drawn on the CPU, then moved)."""
        if self.std == 0:
            return
        for param in params:
            if param.grad is None:
                continue
            placements = getattr(param.grad, "placements", ())
            if any(not placement.is_shard() for placement in placements):
                # Every replica would add its own draw to the same coordinates.
                raise NotImplementedError(
                    f"a gradient has placements {placements}: only sharded (not replicated) gradients are noised"
                )
            local = _local(param.grad)
            dtype = torch.float64 if local.dtype == torch.float64 else torch.float32
            draws = [torch.randn(local.shape, generator=g, dtype=dtype) for g in self._generators]
            standard = draws[0] if len(draws) == 1 else sum(draws) / 2.0
            local.add_((standard * self.std).to(device=local.device, dtype=local.dtype))


class FSDPPrivateStep:
    """One private release per ``step()``: noise on the shards, division by the global expected batch
    size, the optimizer's step, one accounted step, gradients zeroed.

    Guarantee: with ``FSDPGhostClipping.backward`` run on every rank since the last step and the loader
    of ``distributed_data_loader`` (rate ``q``), the released update is the single-process DP-SGD release
    ``(sum_i clip(g_i) + N(0, (sigma C)^2 I)) / (q N)`` over one Poisson sample of the dataset, and the
    accountant records exactly that event (``noise_multiplier = sigma``, ``sample_rate = q``): epsilon is
    the single-process epsilon. Divides by the *expected* batch size, never the realised one (which
    depends on the data).

    ``noise``: ``ShardNoise`` (DP-SGD), or ``privacy_engine.training.fsdp_noise.ShardMechanismNoise``
    (BandMF, BLT on the shards): the accountant records the noise's own event
    (``noise.privacy_event().step_kwargs()``), and a correlated event's ``num_bands`` must equal the loader's
    ``num_groups`` (cyclic sampling; ``ValueError`` at construction otherwise).

    ``accountant`` may be None (nothing recorded: the caller accounts).

    Construction is collective when a process group is initialised: every rank's settings (sigma, C, the
    noise seed, secure mode, the noise's mechanism and strategy, sample rate, expected batch size, the
    parameters' global shapes and dtypes, the accountant) are compared, and ``DistributedSettingsError`` is raised on every rank, naming what
    differs, before anything is released (``DistributedStepError`` if a rank does not arrive in time).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, noise: Any, data_loader: Any, *,
                 accountant: Any = None) -> None:  # fmt: skip
        sample_rate = getattr(data_loader, "sample_rate", None)
        expected = getattr(data_loader, "expected_batch_size", None)
        if sample_rate is None or expected is None:
            raise TypeError(
                "data_loader must be the distributed Poisson loader "
                "(privacy_engine.training.distributed.distributed_data_loader): the step divides by its global "
                "expected batch size and accounts its rate"
            )
        event = noise.privacy_event()
        num_groups = getattr(data_loader, "num_groups", 1)
        if event.num_bands != num_groups:
            # The event's analysis assumes each example takes part at most once in any num_bands consecutive
            # steps (cyclic sampling over num_bands groups); another grouping would be accounted wrongly.
            raise ValueError(
                f"the noise's privacy event needs cyclic sampling over num_bands={event.num_bands} groups and the "
                f"loader samples over num_groups={num_groups}: build the loader with num_groups={event.num_bands} "
                "(DistributedDPDataLoader.from_data_loader(..., num_groups=...))"
            )
        self.privacy_event = event
        self.optimizer = optimizer
        self.noise = noise
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = float(expected)
        self.accountant = accountant
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            job = DistributedJob(process_group=None, rank=dist.get_rank(), world_size=dist.get_world_size(),
                                 timeout=None, wrapper="FSDPPrivateStep", seed_fingerprint=noise.seed_fingerprint,
                                 secure_mode=noise.secure_mode)  # fmt: skip
            job.agree({
                "noise_multiplier": noise.noise_multiplier, "max_grad_norm": noise.max_grad_norm,
                "secure_mode": noise.secure_mode, "sample_rate": self.sample_rate, "noise": noise.settings(),
                "expected_batch_size": self.expected_batch_size,
                "parameters": [(tuple(p.shape), str(p.dtype)) for p in self.params],
                "accountant": None if accountant is None else (accountant.name, sorted(accountant.settings().items())),
            })  # fmt: skip

    def step(self) -> None:
        """Noise, scale, step, account, zero the gradients (every rank, once per global step)."""
        self.noise.add_(self.params)
        for param in self.params:
            if param.grad is not None:
                _local(param.grad).div_(self.expected_batch_size)
        self.optimizer.step()
        if self.accountant is not None:
            self.accountant.step(noise_multiplier=self.noise.noise_multiplier, sample_rate=self.sample_rate,
                                 **self.privacy_event.step_kwargs())  # fmt: skip
        self.optimizer.zero_grad(set_to_none=True)
