"""Examples that interact in the forward or in the loss are refused before anything is released (issue 18).

DP-SGD's bound assumes example i's gradient depends on example i alone. Each refusal below is written as the
user's own training loop through ``PrivacyEngine.make_private`` (hooks and ghost): the error comes at the
forward or while the loss is computed, before backward, so the parameters are unchanged and the accountant
has recorded no step. The accepted cases train, and removing one example moves their release by at most C.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import GradSampleModule, PrivacyEngine, UnsupportedModuleError, connect_private
from privacy_engine.models.validation import InteractingExamplesError

MODES = ["hooks", "ghost"]


def bound_wrapper(model: nn.Module) -> GradSampleModule:
    """A hand-built wrapper bound to a private optimizer: the checks guard what such a pair releases."""
    from privacy_engine import DPOptimizer

    wrapped = GradSampleModule(model)
    wrapped._test_optimizer = DPOptimizer(  # kept alive with the wrapper
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=6
    )
    connect_private(wrapped, wrapped._test_optimizer)
    assert wrapped._consumer is wrapped._test_optimizer
    return wrapped
FEATURES, CLASSES, N, BATCH = 7, 3, 24, 12  # feature and class counts differ from every batch size used
CLIP = 1.0


# ---------------------------------------------------------------------------------------------- models
class BatchStatistics(nn.Module):
    """No parameters, not nn.BatchNorm by type: the same computation under another name."""

    def forward(self, x):
        return F.batch_norm(x, None, None, training=True)


class CentreOverBatch(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


class LayerNormOverBatch(nn.Module):
    """LayerNorm applied across the batch dim (each feature normalised over the examples)."""

    def forward(self, x):
        return F.layer_norm(x.T, (x.shape[0],)).T


class RunningMean(nn.Module):
    """Keeps a running mean of its input in a buffer; its output is per example."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(features))

    def forward(self, x):
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x


class TimeMajorInside(nn.Module):
    """A batch-first model (B, T, F) that runs one layer on (T, B, F): with T == B the shapes agree."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(FEATURES, FEATURES)
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        h = self.inner(x.transpose(0, 1))  # time-major by mistake: the layer sees T as the batch
        return self.head(h.transpose(0, 1).mean(1))


class Sequences(nn.Module):
    """(B, T) tokens -> (B, T, V) logits."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, FEATURES)
        self.head = nn.Linear(FEATURES, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.embedding(ids)))


def mlp(*middle: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 5), *middle, nn.Linear(5, CLASSES))


# ---------------------------------------------------------------------------------------------- harness
def data(drop: int | None = None, *, kind: str = "classes") -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(N, FEATURES, generator=generator, dtype=torch.float64) * 3
    if kind == "tokens":
        x = torch.randint(1, 11, (N, FEATURES), generator=generator)
        y = x.roll(-1, dims=1)
        lengths = torch.randint(2, FEATURES + 1, (N,), generator=generator)
        y = y.masked_fill(torch.arange(FEATURES)[None] >= lengths[:, None], -100)
    elif kind == "sequences":
        x = torch.randn(N, BATCH, FEATURES, generator=generator, dtype=torch.float64)  # T == batch size
        y = torch.randint(0, CLASSES, (N,), generator=generator)
    else:
        y = torch.randint(0, CLASSES, (N,), generator=generator)
    keep = [i for i in range(N) if i != drop]
    return TensorDataset(x[keep], y[keep])


def private(model: nn.Module, mode: str, dataset: TensorDataset, *, batch_size: int = BATCH, poisson: bool = False):
    model = model.double() if next(model.parameters()).is_floating_point() else model
    engine = PrivacyEngine()
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
        data_loader=DataLoader(dataset, batch_size=batch_size), max_grad_norm=CLIP, grad_sample_mode=mode,
        poisson_sampling=poisson,
    )  # fmt: skip
    wrapped, optimizer, loader = out
    return engine, wrapped, optimizer, loader


def assert_refused_before_release(model, mode, loss_fn, *, dataset=None, match: str, error=InteractingExamplesError):
    """The user's loop raises `error` at the first step; nothing was released or accounted."""
    dataset = dataset if dataset is not None else data()
    engine, wrapped, optimizer, loader = private(model, mode, dataset)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(wrapped(x), y)
            loss.backward()
            optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert engine.accountant.steps == 0
    monitor = wrapped._independence.monitor
    wrapped.to_standard_module()  # (or the next forward, or optimizer step) takes the loss monitor off
    stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    assert all(mode is not monitor for mode in stack)
    return wrapped


# ---------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("layer", "name"),
    [(BatchStatistics(), "BatchStatistics"), (CentreOverBatch(), "CentreOverBatch"), (LayerNormOverBatch(), "LayerNormOverBatch")],
)
def test_module_computing_batch_statistics_is_refused_by_name(mode, layer, name):
    assert_refused_before_release(mlp(layer), mode, F.cross_entropy, match=rf"'1' \({name}\) mixes the examples")


@pytest.mark.parametrize("mode", MODES)
def test_buffer_written_from_the_batch_is_refused_and_restored(mode):
    model = mlp(RunningMean(5))
    assert_refused_before_release(model, mode, F.cross_entropy, match=r"buffer '1.running_mean' .* It was restored")
    assert torch.equal(model[1].running_mean, torch.zeros(5))


class RunningMeanAfterWarmUp(RunningMean):
    """Starts its running mean at the second training forward: the first-step check cannot see it."""

    def __init__(self, features: int) -> None:
        super().__init__(features)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x) if self.calls > 3 else x  # (the first step runs the forward 3 times)


@pytest.mark.parametrize("mode", MODES)
def test_buffer_written_after_the_first_step_is_refused(mode):
    model = mlp(RunningMeanAfterWarmUp(5))
    engine, wrapped, optimizer, loader = private(model, mode, data())
    batches = iter(loader)
    x, y = next(batches)
    optimizer.zero_grad()
    F.cross_entropy(wrapped(x), y).backward()
    optimizer.step()
    x, y = next(batches)
    with pytest.raises(InteractingExamplesError, match="buffer '1.running_mean'.*do not release this model"):
        wrapped(x)
    assert engine.accountant.steps == 1


@pytest.mark.parametrize("mode", MODES)
def test_instance_norm_with_running_stats_turned_to_training_after_make_private_is_refused(mode):
    model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.InstanceNorm1d(2, track_running_stats=True), nn.Flatten(), nn.Linear(10, CLASSES))
    model.eval()  # accepted at make_private: eval mode only reads the running statistics
    dataset = TensorDataset(torch.randn(N, 1, 12, dtype=torch.float64), torch.randint(0, CLASSES, (N,)))
    engine, wrapped, optimizer, loader = private(model, mode, dataset)
    wrapped.train()
    before = model[1].running_mean.clone()
    with pytest.raises(UnsupportedModuleError, match=r"'1' is InstanceNorm1d\(track_running_stats=True\)"):
        for x, y in loader:
            F.cross_entropy(wrapped(x), y).backward()
            optimizer.step()
    assert torch.equal(model[1].running_mean, before) and engine.accountant.steps == 0


@pytest.mark.parametrize("mode", MODES)
def test_layer_run_time_major_inside_a_batch_first_model_is_refused(mode):
    assert_refused_before_release(
        TimeMajorInside(), mode, F.cross_entropy, dataset=data(kind="sequences"),
        match=r"the input of 'inner' \(Linear\) does not keep the examples at dim 0",
    )  # fmt: skip


class CentreWhileTraining(nn.Module):
    """Subtracts the batch mean in training mode only (a hand-made batch normalisation); eval: identity."""

    def forward(self, x):
        return x - x.mean(0) if self.training else x


def test_a_module_turned_to_training_after_the_first_step_is_checked_again():
    model = mlp(CentreWhileTraining())
    model[1].eval()  # the first step runs with it in eval mode: nothing mixes, the check passes
    wrapped = bound_wrapper(model.double())
    x = torch.randn(6, FEATURES, dtype=torch.float64)
    wrapped(x).sum().backward()
    model[1].train()
    with pytest.raises(InteractingExamplesError, match=r"'1' \(CentreWhileTraining\) mixes the examples"):
        wrapped(x)


def test_forward_that_cannot_run_on_a_sub_batch_warns_that_it_cannot_be_verified():
    class FixedBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(FEATURES, CLASSES)

        def forward(self, x):
            return self.linear(x.reshape(BATCH, FEATURES))

    wrapped = bound_wrapper(FixedBatch())
    with pytest.warns(UserWarning, match="could not verify that the examples of a batch are independent"):
        wrapped(torch.randn(BATCH, FEATURES))


# ---------------------------------------------------------------------------------------------- losses
def weighted_cross_entropy(out, y):
    return nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 5.0], dtype=out.dtype))(out, y)


def weighted_nll(out, y):
    return F.nll_loss(F.log_softmax(out, -1), y, weight=torch.tensor([3.0, 1.0, 1.0], dtype=out.dtype))


def token_cross_entropy(logits, labels):
    return nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))  # ignore_index -100


def masked_token_mean(logits, labels):
    mask = (labels != -100).to(logits.dtype)
    per_token = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    return (per_token * mask).sum() / mask.sum()


def info_nce(out, y):
    a = F.normalize(out, dim=-1)
    return F.cross_entropy(a @ a.roll(1, 0).T / 0.1, torch.arange(len(out)))


def pairwise_similarity(out, y):
    similarity = F.cosine_similarity(out[:, None], out[None], dim=-1)
    return -similarity.logsumexp(1).mean()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("loss_fn", "match"),
    [
        (weighted_cross_entropy, r"F.cross_entropy\(weight=.*privacy_engine.losses.per_example_token_cross_entropy"),
        (weighted_nll, r"F.nll_loss\(weight=.*reduction='none'"),
        (info_nce, r"compares the examples of the batch"),
        (pairwise_similarity, r"compares the examples of the batch"),
    ],
)
def test_loss_coupling_the_examples_is_refused(mode, loss_fn, match):
    assert_refused_before_release(mlp(nn.Tanh()), mode, loss_fn, match=match)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("loss_fn", "match"),
    [
        (token_cross_entropy, r"ignore_index=-100.*per_example_token_cross_entropy"),
        (masked_token_mean, r"divided by a quantity summed over the batch"),
    ],
)
def test_token_loss_normalised_over_the_batch_is_refused(mode, loss_fn, match):
    assert_refused_before_release(Sequences(), mode, loss_fn, dataset=data(kind="tokens"), match=match)


def test_clip_in_batch_logits_are_refused():
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPConfig(
        text_config={"vocab_size": 20, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 8},
        vision_config={"image_size": 8, "patch_size": 4, "hidden_size": 8, "intermediate_size": 16,
                       "num_hidden_layers": 1, "num_attention_heads": 2},
        projection_dim=6,
    )  # fmt: skip
    torch.manual_seed(0)
    wrapped = bound_wrapper(transformers.CLIPModel(config).train())
    ids, pixels = torch.randint(1, 20, (5, 6)), torch.randn(5, 3, 8, 8)
    # logits_per_image is batch x batch: every row depends on every example's text
    with pytest.raises(InteractingExamplesError, match=r"the output of the top-level module \(CLIPModel\) does not keep the examples"):
        wrapped(input_ids=ids, pixel_values=pixels)
    with pytest.raises((InteractingExamplesError, RuntimeError)):  # the contrastive loss (hf_losses refuses it first)
        wrapped(input_ids=ids, pixel_values=pixels, return_loss=True)


def test_loss_computed_inside_the_forward_is_checked_too():
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp(nn.Tanh())

        def forward(self, x, labels):
            return weighted_cross_entropy(self.body(x), labels)

    wrapped = bound_wrapper(WithLoss().double())
    x, y = data().tensors
    with pytest.raises(InteractingExamplesError, match=r"F.cross_entropy\(weight=\.\.\., reduction='mean'\)"):
        wrapped(x, y)


class CountingMode(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def function_modes() -> list:
    """The torch-function mode stack, without loss watchers (another test's wrapper may leave a finished one,
    removed whenever the garbage collector or a later watcher gets to it)."""
    from privacy_engine.capture.loss_coupling import LossCouplingMonitor

    stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    return [mode for mode in stack if not isinstance(mode, LossCouplingMonitor)]


def watchers_of(wrapped) -> list:
    stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    return [mode for mode in stack if getattr(mode, "owner", None) is not None and mode.owner() is wrapped._independence]


@pytest.mark.parametrize("mode", MODES)
def test_user_function_modes_keep_their_order_and_the_loss_is_still_watched(mode):
    engine, wrapped, optimizer, loader = private(mlp(nn.Tanh()), mode, data())
    x, y = next(iter(loader))
    before = function_modes()  # (other tests' wrappers may leave a watcher of a forward never finished)
    with CountingMode() as user_mode:  # entered before the forward, exited before the loss
        out = wrapped(x)
    assert user_mode not in function_modes() and user_mode.calls > 0
    with pytest.raises(InteractingExamplesError, match="weight"):
        weighted_cross_entropy(out, y)
    out = wrapped(x)  # a forward without backward, then another: the first one's watcher is gone
    assert function_modes() == before
    F.cross_entropy(out, y).backward()
    optimizer.step()
    assert engine.accountant.steps == 1 and function_modes() == before and not watchers_of(wrapped)


def test_metrics_under_no_grad_are_not_refused():
    engine, wrapped, optimizer, loader = private(mlp(nn.Tanh()), "hooks", data())
    x, y = next(iter(loader))
    out = wrapped(x)
    with torch.no_grad():
        weighted_cross_entropy(out, y)  # a metric: no gradient flows from it
    F.cross_entropy(out, y).backward()
    optimizer.step()
    assert engine.accountant.steps == 1


# ---------------------------------------------------------------------------------------------- accepted
class Normalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3)
        self.group = nn.GroupNorm(2, 4)
        self.instance = nn.InstanceNorm1d(4, affine=True)
        self.layer = nn.LayerNorm(FEATURES - 2)
        self.head = nn.Linear(4 * (FEATURES - 2), CLASSES)
        self.dropout = nn.Dropout(0.3)
        self.functional_dropout = 0.2

    def forward(self, x):
        h = self.layer(self.instance(self.group(self.conv(x[:, None]))))
        return self.head(F.dropout(self.dropout(h).flatten(1), self.functional_dropout, self.training))


def sum_cross_entropy(out, y):
    return F.cross_entropy(out, y, reduction="sum") / BATCH  # a constant, not the batch's size


def bce_with_pos_weight(out, y):
    # Mean over elements, each scaled by pos_weight where its target is 1: divided by the element count
    # (B x classes), not by a total weight, so example i's term is its own.
    return F.binary_cross_entropy_with_logits(out, F.one_hot(y, CLASSES).to(out.dtype), pos_weight=torch.tensor([1.0, 3.0, 0.5], dtype=out.dtype))


ACCEPTED = {
    "ce_mean": (lambda: mlp(nn.Tanh()), F.cross_entropy),
    "mse": (lambda: mlp(nn.Tanh()), lambda out, y: F.mse_loss(out, F.one_hot(y, CLASSES).to(out.dtype))),
    "ce_sum": (lambda: mlp(nn.Tanh()), sum_cross_entropy),
    "bce_pos_weight": (lambda: mlp(nn.Tanh()), bce_with_pos_weight),
    "norms_and_dropout": (Normalised, F.cross_entropy),
    "uniform_weight": (lambda: mlp(nn.Tanh()), nn.CrossEntropyLoss(weight=torch.ones(CLASSES, dtype=torch.float64))),
}


def released_sum(name: str, mode: str, drop: int | None) -> torch.Tensor:
    build, loss_fn = ACCEPTED[name]
    torch.manual_seed(0)
    model = build().double()
    if name == "norms_and_dropout":
        model.dropout.p = model.functional_dropout = 0.0  # the same forward on D and D' (dropout: see below)
    dataset = data(drop)
    engine, wrapped, optimizer, loader = private(model, mode, dataset, batch_size=len(dataset), poisson=True)
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(wrapped(x), y).backward()
        optimizer.step()
        break
    assert engine.accountant.steps == 1
    scale = loader.expected_batch_size
    return torch.cat([(b - p.detach()).flatten() * scale for b, p in zip(before, model.parameters())])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_losses_and_layers_move_the_release_by_at_most_the_clip_norm(name, mode):
    full = released_sum(name, mode, drop=None)
    assert float(full.norm()) > 2 * CLIP  # several examples contribute: the test can fail
    for drop in (0, 9):
        fewer = released_sum(name, mode, drop=drop)
        assert float((full - fewer).norm()) <= CLIP * (1 + 1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_per_example_token_loss_trains(mode):
    losses = pytest.importorskip("privacy_engine.losses")
    model = Sequences()
    engine, wrapped, optimizer, loader = private(model, mode, data(kind="tokens"))
    for x, y in loader:
        optimizer.zero_grad()
        losses.per_example_token_cross_entropy(wrapped(x).double(), y).backward()
        optimizer.step()
    assert engine.accountant.steps == len(loader)


@pytest.mark.parametrize("mode", MODES)
def test_dropout_models_train_and_keep_their_randomness(mode):
    model = Normalised()
    _, wrapped, _, loader = private(model, mode, data())
    x, _ = next(iter(loader))
    torch.manual_seed(5)
    first = wrapped(x)  # runs the row check (deterministic, RNG restored) then the real forward
    torch.manual_seed(5)
    second = wrapped(x)
    assert torch.equal(first, second)  # the check consumed no random numbers
    wrapped.eval()
    assert not torch.equal(first, wrapped(x))  # dropout was active in training


@pytest.mark.parametrize("mode", MODES)
def test_hf_gpt2_with_dropout_trains(mode):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=11, n_embd=8, n_layer=1, n_head=2, n_positions=8, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)  # dropout 0.1 everywhere
    ids = torch.randint(1, 11, (N, FEATURES))
    engine = PrivacyEngine()
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(TensorDataset(ids), batch_size=BATCH),
        noise_multiplier=1.0, max_grad_norm=CLIP, grad_sample_mode=mode, poisson_sampling=False,
    )  # fmt: skip
    wrapped, optimizer, loader = out
    for (batch,) in loader:
        optimizer.zero_grad()
        wrapped(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    assert engine.accountant.steps == len(loader)


# ---------------------------------------------------------------------------------------------- the leak
def hand_built_release(model: nn.Module, loss_fn, drop_outlier: bool) -> torch.Tensor:
    """strict=False (the checks only warn), hooks, noise 0, SGD lr 1, one step on D or on D without its
    outlier (row 0: far from the others, the only example of class 2)."""
    from privacy_engine import DPOptimizer

    generator = torch.Generator().manual_seed(8)
    x = torch.randn(N, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 2, (N,), generator=generator)
    x[0], y[0] = x[0] * 20, 2
    x, y = (x[1:], y[1:]) if drop_outlier else (x, y)
    wrapped = GradSampleModule(model, strict=False)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=N)
    connect_private(wrapped, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="strict=False"):
        loss_fn(wrapped(x), y).backward()
    optimizer.step()
    wrapped.to_standard_module()
    return torch.cat([(b - p.detach()).flatten() * N for b, p in zip(before, model.parameters())])


def heavily_weighted_cross_entropy(out, y):
    return nn.CrossEntropyLoss(weight=torch.tensor([1.0, 1.0, 30.0], dtype=out.dtype))(out, y)


@pytest.mark.parametrize(
    ("build", "loss_fn"),
    [(lambda: mlp(BatchStatistics()), F.cross_entropy), (lambda: mlp(nn.Tanh()), heavily_weighted_cross_entropy)],
    ids=["batch_statistics", "weighted_cross_entropy"],
)
def test_what_is_refused_does_leak_past_the_clip_norm(build, loss_fn):
    """The refusals are not over-cautious: allowed to train, one example moves the release by more than C."""
    torch.manual_seed(0)
    model = build().double()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    full = hand_built_release(model, loss_fn, drop_outlier=False)
    model.load_state_dict(state)
    fewer = hand_built_release(model, loss_fn, drop_outlier=True)
    assert float((full - fewer).norm()) > 2 * CLIP


def test_arguments_the_check_cannot_split_per_example_give_a_warning_not_a_refusal():
    # EmbeddingBag's flat layout: indices of every bag in one 1-D tensor, plus one offset per bag. The check
    # slices only tensors with the batch's size at dim 0 (the offsets), so its sub-batch is not the model's:
    # the mismatch it sees says nothing about the model, which is per-example.
    class Bags(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(10, 4, mode="mean")

        def forward(self, indices, offsets):
            return self.bag(indices, offsets)

    wrapped = bound_wrapper(Bags().double())
    indices, offsets = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]), torch.tensor([0, 2, 3, 7])
    with pytest.warns(UserWarning, match=r"tensors without 4 entries at dim 0 \(shapes \[\(9,\)\]\)"):
        wrapped(indices, offsets).sum().backward()
