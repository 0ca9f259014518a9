"""Recurrent layers (``grad_samplers.rnn``): ``nn.LSTM``/``nn.GRU``/``nn.RNN`` as users write them get exact
per-sample gradients (float64 per-example loop, each example run alone, packed input packed per example),
in hooks and ghost modes and through the engine; outputs keep ``nn.LSTM``'s structure; state dicts are
unchanged; Opacus-named layers load torch's and old Opacus's keys; unsupported calls fail clearly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_matches_reference, per_example_reference
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, TensorDataset

from grad_samplers import rnn as rnn_module
from privacy_engine import GradSampleModule, ParameterUsageError, PrivacyEngine
from privacy_engine.clipping import PerSampleGradientClipper
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.clipping.rule import clip_factors
from privacy_engine.models.validation import UnsupportedModuleError
from privacy_engine.opacus.recurrent import DPGRU, DPLSTM, DPRNN, torch_rnn_state_dict

DOUBLE = torch.float64
BATCH, STEPS, FEATURES, HIDDEN, PROJECTED = 3, 4, 3, 3, 2
KINDS = {
    "lstm": lambda **kw: nn.LSTM(FEATURES, HIDDEN, **kw),
    "gru": lambda **kw: nn.GRU(FEATURES, HIDDEN, **kw),
    "rnn_tanh": lambda **kw: nn.RNN(FEATURES, HIDDEN, **kw),
    "rnn_relu": lambda **kw: nn.RNN(FEATURES, HIDDEN, nonlinearity="relu", **kw),
    "lstm_proj": lambda **kw: nn.LSTM(FEATURES, HIDDEN, proj_size=PROJECTED, **kw),
}
# Unsorted on purpose (for enforce_sorted=False); "sorted" inputs use the same lengths in descending order.
LENGTHS = torch.tensor([2, 4, 3])


class Recurrent(nn.Module):
    """Batch-first around any recurrent layer: ``(x (B, T, F), lengths (B,) or None, h0/c0 (B, L*D, size)
    or None) -> (B, K)``, everything the layer returns (padded output, h_n, c_n) flattened per example, so
    the per-example reference can narrow every argument to one example. ``packing``: "padded", "sorted"
    (enforce_sorted=True) or "unsorted" (enforce_sorted=False)."""

    def __init__(self, layer: nn.RNNBase, packing: str = "padded") -> None:
        super().__init__()
        self.layer, self.packing = layer, packing

    def forward(self, x, lengths=None, h0=None, c0=None):
        layer, steps = self.layer, x.shape[1]
        sequence = x if layer.batch_first else x.transpose(0, 1)
        if self.packing != "padded":
            sequence = pack_padded_sequence(sequence, lengths, batch_first=layer.batch_first,
                                            enforce_sorted=self.packing == "sorted")
        state = None
        if h0 is not None:
            state = h0.transpose(0, 1).contiguous()
            if c0 is not None:
                state = (state, c0.transpose(0, 1).contiguous())
        output, hidden = layer(sequence, state)
        if isinstance(output, PackedSequence):
            output, _ = pad_packed_sequence(output, batch_first=True, total_length=steps)
        elif not layer.batch_first:
            output = output.transpose(0, 1)
        states = hidden if isinstance(hidden, tuple) else (hidden,)
        return torch.cat([output.flatten(1)] + [s.transpose(0, 1).flatten(1) for s in states], dim=1)


def make_case(kind: str, packing: str, *, num_layers=2, bidirectional=False, batch_first=True, with_state=False,
              seed=0, **layer_options):
    """(model, args, probe) in float64."""
    torch.manual_seed(seed)
    layer = KINDS[kind](num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first,
                        **layer_options).to(DOUBLE)
    model = Recurrent(layer, packing)
    x = torch.randn(BATCH, STEPS, FEATURES, dtype=DOUBLE)
    lengths = None
    if packing != "padded":
        lengths = LENGTHS.sort(descending=True).values if packing == "sorted" else LENGTHS
    h0 = c0 = None
    if with_state:
        directions = 2 if bidirectional else 1
        h0 = torch.randn(BATCH, num_layers * directions, layer.proj_size or HIDDEN, dtype=DOUBLE)
        if isinstance(layer, nn.LSTM):
            c0 = torch.randn(BATCH, num_layers * directions, HIDDEN, dtype=DOUBLE)
    with torch.no_grad():
        probe = torch.randn_like(model(x, lengths, h0, c0))
    return model, (x, lengths, h0, c0), probe


def example_losses(output, probe):
    return (torch.tanh(output) * probe).sum(dim=1)


def reference(model, args, probe):
    """Each example alone (its own packed sequence of batch 1), float64, no wrapper."""
    tensors = [a for a in args if a is not None]
    names = [n for n, a in zip(("x", "lengths", "h0", "c0"), args) if a is not None]

    def loss_of(output, index):
        return example_losses(output, probe[index : index + 1]).sum()

    class Positional(nn.Module):  # per_example_reference narrows positional tensors only
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *values):
            return self.inner(**dict(zip(names, values)))

    per_sample = per_example_reference(Positional(model), tensors, loss_of)
    return {name.removeprefix("inner."): value for name, value in per_sample.items()}


def run_wrapped(model, args, probe, reduction="sum"):
    wrapped = GradSampleModule(model, loss_reduction=reduction)
    losses = example_losses(wrapped(*args), probe)
    (losses.sum() if reduction == "sum" else losses.mean()).backward()
    return wrapped


CASES = [
    pytest.param(kind, packing, bidirectional, batch_first, with_state, id=f"{kind}-{packing}-{'bi' if bidirectional else 'uni'}-"
                 f"{'bf' if batch_first else 'sf'}-{'h0' if with_state else 'no_h0'}")
    for kind in KINDS
    for packing in ("padded", "sorted", "unsorted")
    for bidirectional in (False, True)
    for batch_first, with_state in ((True, False), (False, True))
]


# ---------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind, packing, bidirectional, batch_first, with_state", CASES)
def test_per_sample_gradients_match_per_example_loop(kind, packing, bidirectional, batch_first, with_state):
    model, args, probe = make_case(kind, packing, bidirectional=bidirectional, batch_first=batch_first,
                                   with_state=with_state)
    expected = reference(model, args, probe)
    run_wrapped(model, args, probe)
    assert_matches_reference(model, expected)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("packing", ["padded", "unsorted"])
def test_single_layer_without_bias_mean_reduction(kind, packing):
    model, args, probe = make_case(kind, packing, num_layers=1, bias=False, bidirectional=True)
    expected = reference(model, args, probe)
    run_wrapped(model, args, probe, reduction="mean")
    assert_matches_reference(model, expected)


def test_initial_state_that_needs_gradient_receives_it():
    model, (x, lengths, h0, c0), probe = make_case("lstm", "unsorted", with_state=True, bidirectional=True)
    h0.requires_grad_()
    c0.requires_grad_()
    plain = copy.deepcopy(model)
    h0_plain, c0_plain = h0.detach().clone().requires_grad_(), c0.detach().clone().requires_grad_()
    example_losses(plain(x, lengths, h0_plain, c0_plain), probe).sum().backward()
    run_wrapped(model, (x, lengths, h0, c0), probe)
    torch.testing.assert_close(h0.grad, h0_plain.grad)
    torch.testing.assert_close(c0.grad, c0_plain.grad)


def test_input_gradient_equals_native_layer():
    model, (x, lengths, h0, c0), probe = make_case("gru", "unsorted", bidirectional=True)
    plain = copy.deepcopy(model)
    x_plain = x.clone().requires_grad_()
    example_losses(plain(x_plain, lengths), probe).sum().backward()
    x.requires_grad_()
    run_wrapped(model, (x, lengths, h0, c0), probe)
    torch.testing.assert_close(x.grad, x_plain.grad)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_bare_sequence_first_layer_in_sequence_first_wrapper():
    """The user's nn.LSTM as the model itself, (T, B, F) input, batch_first=False wrapper, tuple output."""
    torch.manual_seed(1)
    lstm = nn.LSTM(FEATURES, HIDDEN, num_layers=2).to(DOUBLE)
    x = torch.randn(STEPS, BATCH, FEATURES, dtype=DOUBLE)
    probe = torch.randn(STEPS, BATCH, HIDDEN, dtype=DOUBLE)

    def loss_of(result, index):
        output, (h_n, c_n) = result
        return (output * probe[:, index : index + 1]).sum() + h_n.sum() + (c_n**2).sum()

    expected = per_example_reference(lstm, [x], loss_of, batch_dim=1)
    wrapped = GradSampleModule(lstm, batch_first=False, loss_reduction="sum")
    output, (h_n, c_n) = wrapped(x)
    ((output * probe).sum() + h_n.sum() + (c_n**2).sum()).backward()
    assert_matches_reference(lstm, expected)


def test_frozen_weights_get_no_grad_sample_and_the_rest_is_exact():
    model, args, probe = make_case("lstm", "unsorted", bidirectional=True)
    model.layer.weight_ih_l0.requires_grad_(False)
    model.layer.bias_hh_l1_reverse.requires_grad_(False)
    expected = reference(model, args, probe)
    run_wrapped(model, args, probe)
    assert_matches_reference(model, expected)
    assert not hasattr(model.layer.weight_ih_l0, "grad_sample")


def test_layer_in_eval_mode_inside_training_model_is_exact_without_dropout():
    model, args, probe = make_case("lstm", "sorted", dropout=0.5)
    model.layer.eval()  # its dropout is off; the wrapper still trains
    expected = reference(model, args, probe)
    run_wrapped(model, args, probe)
    assert_matches_reference(model, expected)


def test_layer_inside_module_with_own_parameter_runs_under_vmap_exactly():
    """A learned initial state on the parent: the parent's torch.func fallback claims the layer, which
    then runs its vmap-safe decomposition instead of the fused kernel (no batching rule)."""

    class LearnedState(nn.Module):
        def __init__(self):
            super().__init__()
            self.h0 = nn.Parameter(torch.randn(2, 1, HIDDEN))
            self.gru = nn.GRU(FEATURES, HIDDEN, num_layers=2, batch_first=True)

        def forward(self, x):
            output, h_n = self.gru(x, self.h0.expand(-1, x.shape[0], -1).contiguous())
            return torch.cat([output.flatten(1), h_n.transpose(0, 1).flatten(1)], dim=1)

    torch.manual_seed(2)
    model = LearnedState().to(DOUBLE)
    x = torch.randn(BATCH, STEPS, FEATURES, dtype=DOUBLE)
    probe = torch.randn(BATCH, STEPS * HIDDEN + 2 * HIDDEN, dtype=DOUBLE)
    expected = per_example_reference(model, [x], lambda out, i: example_losses(out, probe[i : i + 1]).sum())
    wrapped = GradSampleModule(model, loss_reduction="sum")
    example_losses(wrapped(x), probe).sum().backward()
    assert_matches_reference(model, expected)


def test_opacus_named_layers_are_exact():
    torch.manual_seed(3)
    for layer in (DPLSTM(FEATURES, HIDDEN, 2, True, True, 0.0, True), DPGRU(FEATURES, HIDDEN, batch_first=True),
                  DPRNN(FEATURES, HIDDEN, 1, True, True, nonlinearity="relu")):
        model = Recurrent(layer.to(DOUBLE), "unsorted")
        x = torch.randn(BATCH, STEPS, FEATURES, dtype=DOUBLE)
        with torch.no_grad():
            probe = torch.randn_like(model(x, LENGTHS))
        expected = reference(model, (x, LENGTHS, None, None), probe)
        run_wrapped(model, (x, LENGTHS, None, None), probe)
        assert_matches_reference(model, expected)


class CellLoop(nn.Module):
    """A user's own time loop over a recurrent cell; ``sequence_first``: input (T, B, F), else (B, T, F)."""

    def __init__(self, cell: nn.RNNCellBase, sequence_first: bool = False) -> None:
        super().__init__()
        self.cell, self.sequence_first = cell, sequence_first

    def forward(self, x):
        steps = x.unbind(0 if self.sequence_first else 1)
        state, outputs = None, []
        for x_t in steps:
            state = self.cell(x_t, state)
            outputs.append(torch.cat(state, dim=1) if isinstance(state, tuple) else state)
        return torch.stack(outputs, dim=0 if self.sequence_first else 1)


CELLS = {
    "lstm_cell": lambda: nn.LSTMCell(FEATURES, HIDDEN),
    "gru_cell": lambda: nn.GRUCell(FEATURES, HIDDEN),
    "rnn_cell_relu_no_bias": lambda: nn.RNNCell(FEATURES, HIDDEN, nonlinearity="relu", bias=False),
}


@pytest.mark.parametrize("sequence_first", [False, True], ids=["batch_first", "sequence_first"])
@pytest.mark.parametrize("cell", list(CELLS))
def test_cells_in_a_user_loop_are_exact(cell, sequence_first, recwarn):
    """The fused cell kernels have no batching rule (LSTMCell failed, the others looped per example)."""
    torch.manual_seed(11)
    model = CellLoop(CELLS[cell]().to(DOUBLE), sequence_first)
    x = torch.randn(BATCH, STEPS, FEATURES, dtype=DOUBLE)
    batch_dim = 1 if sequence_first else 0
    if sequence_first:
        x = x.transpose(0, 1).contiguous()
    probe = torch.randn_like(model(x))

    def loss_of(output, index):
        return (output * probe.narrow(batch_dim, index, 1)).sum()

    expected = per_example_reference(model, [x], loss_of, batch_dim=batch_dim)
    wrapped = GradSampleModule(model, batch_first=not sequence_first, loss_reduction="sum")
    (wrapped(x) * probe).sum().backward()
    assert_matches_reference(model, expected)
    assert not [w for w in recwarn if "batching rule" in str(w.message)]


# ---------------------------------------------------------------------------------------- dropout
def test_dropout_one_zeroes_between_layers_like_the_native_layer():
    """p = 1 is deterministic: the second layer sees zeros (so its input weights get zero gradient) and the
    first layer is reached only through its final state, exactly as with the fused kernel."""
    model, args, probe = make_case("lstm", "unsorted", bidirectional=True, dropout=1.0)
    expected = reference(model, args, probe)
    run_wrapped(model, args, probe)
    assert_matches_reference(model, expected)
    assert float(model.layer.weight_ih_l1.grad_sample.abs().max()) == 0.0
    assert float(model.layer.weight_ih_l0.grad_sample.abs().max()) > 0.0


class _RecordedDropout:
    """Stands in for F.dropout: a seeded mask, kept so the reference can apply the same one."""

    def __init__(self):
        self.masks = []
        self.generator = torch.Generator().manual_seed(7)

    def __call__(self, input, p=0.5, training=True, inplace=False):
        keep = torch.rand(input.shape, generator=self.generator) >= p
        mask = keep.to(input.dtype) / (1 - p)
        self.masks.append(mask)
        return input * mask


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("packing", ["padded", "unsorted"])
def test_dropout_gradients_follow_the_masks_the_forward_drew(kind, packing, monkeypatch):
    """Reference: each example through two native one-layer layers with the recorded mask between them."""
    model, (x, lengths, _, _), probe = make_case(kind, packing, bidirectional=True, dropout=0.5)
    layer = model.layer
    dropout = _RecordedDropout()
    monkeypatch.setattr(rnn_module.F, "dropout", dropout)
    run_wrapped(model, (x, lengths, None, None), probe)
    monkeypatch.undo()
    (mask,) = dropout.masks  # (B, T, 2H), padded layout, the caller's order

    first = KINDS[kind](num_layers=1, bidirectional=True, batch_first=True).to(DOUBLE)
    second = type(first)(2 * HIDDEN, HIDDEN, bidirectional=True, batch_first=True).to(DOUBLE)
    for name, param in layer.named_parameters():
        target, renamed = (first, name) if "_l0" in name else (second, name.replace("_l1", "_l0"))
        getattr(target, renamed).data.copy_(param.detach())
    for index in range(BATCH):
        first.zero_grad()
        second.zero_grad()
        length = STEPS if lengths is None else int(lengths[index])
        inputs = x[index : index + 1, :length]
        middle, h_first = first(inputs)
        output, h_second = second(middle * mask[index : index + 1, :length])
        states = [h_first, h_second]
        if kind == "lstm":
            h_n = torch.cat([h_first[0], h_second[0]])
            c_n = torch.cat([h_first[1], h_second[1]])
            states = [h_n, c_n]
        else:
            states = [torch.cat(states)]
        padded = F.pad(output, (0, 0, 0, STEPS - length))
        result = torch.cat([padded.flatten(1)] + [s.transpose(0, 1).flatten(1) for s in states], dim=1)
        example_losses(result, probe[index : index + 1]).sum().backward()
        for name, param in layer.named_parameters():
            target, renamed = (first, name) if "_l0" in name else (second, name.replace("_l1", "_l0"))
            torch.testing.assert_close(param.grad_sample[index], getattr(target, renamed).grad,
                                       msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("packing", ["sorted", "unsorted"])
@pytest.mark.parametrize("kind", ["lstm", "gru", "lstm_proj"])
def test_packed_output_has_the_native_structure(kind, packing):
    torch.manual_seed(4)
    layer = KINDS[kind](num_layers=2, bidirectional=True).to(DOUBLE)
    native = copy.deepcopy(layer)
    lengths = LENGTHS.sort(descending=True).values if packing == "sorted" else LENGTHS
    x = torch.randn(STEPS, BATCH, FEATURES, dtype=DOUBLE)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=packing == "sorted")
    wrapped = GradSampleModule(layer, batch_first=False)
    output, hidden = wrapped(packed)
    expected_output, expected_hidden = native(packed)
    assert isinstance(output, PackedSequence)
    torch.testing.assert_close(output.data, expected_output.data)
    assert torch.equal(output.batch_sizes, expected_output.batch_sizes)
    for ours, theirs in ((output.sorted_indices, expected_output.sorted_indices),
                         (output.unsorted_indices, expected_output.unsorted_indices)):
        assert (ours is None and theirs is None) or torch.equal(ours, theirs)
    torch.testing.assert_close(hidden, expected_hidden)


def test_packed_batch_size_is_the_number_of_sequences():
    """Embedding (B examples) -> packed LSTM: the wrapper must count sequences, not rows of .data."""

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(10, FEATURES)
            self.lstm = nn.LSTM(FEATURES, HIDDEN, batch_first=True)
            self.head = nn.Linear(HIDDEN, 2)

        def forward(self, tokens, lengths):
            packed = pack_padded_sequence(self.embedding(tokens), lengths, batch_first=True, enforce_sorted=False)
            _, (h_n, _) = self.lstm(packed)
            return self.head(h_n[-1])

    torch.manual_seed(5)
    model = Tagger().to(DOUBLE)
    tokens = torch.randint(0, 10, (BATCH, STEPS))
    expected = per_example_reference(model, [tokens, LENGTHS], lambda out, i: out.square().sum())
    wrapped = GradSampleModule(model, loss_reduction="sum")
    wrapped(tokens, LENGTHS).square().sum().backward()  # .data has sum(LENGTHS) = 9 rows, not 3
    assert_matches_reference(model, expected)


def test_first_backward_check_passes_and_catches_use_outside_the_layer():
    model, args, probe = make_case("lstm", "unsorted", bidirectional=True)
    wrapped = GradSampleModule(model)
    example_losses(wrapped(*args), probe).mean().backward()  # the armed check runs here: no error
    assert wrapped._check_state == "done"

    model, args, probe = make_case("gru", "padded")
    wrapped = GradSampleModule(model)
    loss = example_losses(wrapped(*args), probe).mean() + model.layer.weight_hh_l1.square().sum()
    with pytest.raises(ParameterUsageError, match="weight_hh_l1"):
        loss.backward()


def test_empty_batch_gives_empty_per_sample_gradients():
    torch.manual_seed(6)
    lstm = nn.LSTM(FEATURES, HIDDEN, num_layers=2, batch_first=True, bidirectional=True)
    wrapped = GradSampleModule(lstm)
    output, _ = wrapped(torch.randn(0, STEPS, FEATURES))
    output.sum().backward()
    for param in lstm.parameters():
        assert param.grad_sample.shape == (0, *param.shape)


# ---------------------------------------------------------------------------------------- ghost mode
@pytest.mark.parametrize(
    "kind, packing, bidirectional", [("lstm", "unsorted", True), ("gru", "padded", False), ("lstm_proj", "sorted", True),
                                     ("rnn_relu", "unsorted", False)]
)
def test_ghost_clipped_sum_matches_per_example_loop(kind, packing, bidirectional):
    max_grad_norm = 0.3  # small enough that every example is clipped
    model, args, probe = make_case(kind, packing, bidirectional=bidirectional, with_state=True)
    per_sample = reference(model, args, probe)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(dim=1) for g in per_sample.values()))
    factors = clip_factors(norms, max_grad_norm)
    expected = {name: torch.tensordot(factors, g, dims=1) for name, g in per_sample.items()}

    wrapped = GhostClippingModule(model, loss_reduction="sum")
    clipper = PerSampleGradientClipper([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    wrapped.attach_clipper(clipper)
    example_losses(wrapped(*args), probe).sum().backward()
    torch.testing.assert_close(wrapped.last_per_sample_norms.flatten(), norms)
    clipper.pre_step()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------------------------- engine
class CharModel(nn.Module):
    """Embedding 8 -> 2-layer LSTM 16 (dropout between layers) -> Linear on the last state."""

    def __init__(self, layer_type=nn.LSTM):
        super().__init__()
        self.embedding = nn.Embedding(12, 8)
        self.recurrent = layer_type(8, 16, num_layers=2, dropout=0.2, batch_first=True)
        self.head = nn.Linear(16, 12)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.embedding(tokens), lengths.clamp(min=1), batch_first=True,
                                      enforce_sorted=False)
        _, hidden = self.recurrent(packed)
        h_n = hidden[0] if isinstance(hidden, tuple) else hidden
        return self.head(h_n[-1])


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("layer_type", [nn.LSTM, nn.GRU])
def test_engine_trains_a_packed_recurrent_model(mode, layer_type):
    torch.manual_seed(8)
    tokens = torch.randint(0, 12, (48, 6))
    lengths = torch.randint(1, 7, (48,))
    labels = torch.randint(0, 12, (48,))
    model = CharModel(layer_type)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(tokens, lengths, labels), batch_size=12)
    engine = PrivacyEngine(accountant="rdp")
    result = engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                                 max_grad_norm=1.0, grad_sample_mode=mode)
    private_model, private_optimizer, private_loader = result
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    steps = 0
    for batch_tokens, batch_lengths, batch_labels in private_loader:
        if len(batch_tokens) == 0:
            continue  # packing needs a sequence; the model is the user's
        private_optimizer.zero_grad()
        F.cross_entropy(private_model(batch_tokens, batch_lengths), batch_labels).backward()
        private_optimizer.step()
        steps += 1
        if steps == 3:
            break
    assert steps == 3
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all() and not torch.equal(param, before[name]), name


# ---------------------------------------------------------------------------------------- state dicts
def test_state_dict_is_unchanged_and_a_pretrained_layer_loads():
    torch.manual_seed(9)
    pretrained = nn.LSTM(FEATURES, HIDDEN, num_layers=2, bidirectional=True, proj_size=PROJECTED)
    model = nn.LSTM(FEATURES, HIDDEN, num_layers=2, bidirectional=True, proj_size=PROJECTED)
    model.load_state_dict(pretrained.state_dict())
    wrapped = GradSampleModule(model)
    assert list(wrapped.state_dict()) == list(pretrained.state_dict())
    output, _ = wrapped(torch.randn(STEPS, BATCH, FEATURES))
    output.sum().backward()
    plain = wrapped.to_standard_module()
    assert type(plain) is nn.LSTM and list(plain.state_dict()) == list(pretrained.state_dict())
    fresh = nn.LSTM(FEATURES, HIDDEN, num_layers=2, bidirectional=True, proj_size=PROJECTED)
    fresh.load_state_dict(plain.state_dict())
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name])


def test_opacus_named_layers_share_torch_state_dicts_and_read_old_opacus_keys():
    torch.manual_seed(10)
    torch_layer = nn.LSTM(FEATURES, HIDDEN, num_layers=2, bidirectional=True)
    ours = DPLSTM(FEATURES, HIDDEN, num_layers=2, bidirectional=True)
    assert isinstance(ours, nn.LSTM) and list(ours.state_dict()) == list(torch_layer.state_dict())
    ours.load_state_dict(torch_layer.state_dict())
    torch_layer.load_state_dict(ours.state_dict())
    old_keys = {}
    for name, value in torch_layer.state_dict().items():  # weight_ih_l1_reverse -> l1_reverse.ih.weight
        kind, matrix, rest = name.split("_", 2)
        old_keys[f"{rest}.{matrix}.{kind}"] = value + 1
    assert "l1_reverse.ih.weight" in old_keys
    ours.load_state_dict(old_keys)
    torch.testing.assert_close(ours.weight_ih_l1_reverse, old_keys["l1_reverse.ih.weight"])
    model = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.LSTM(FEATURES, HIDDEN, num_layers=2, bidirectional=True))
    checkpoint = {"0.weight": torch.zeros(FEATURES, FEATURES), "0.bias": torch.zeros(FEATURES)}
    checkpoint.update({f"1.{key}": value for key, value in old_keys.items()})
    model.load_state_dict(torch_rnn_state_dict(checkpoint))
    torch.testing.assert_close(model[1].bias_hh_l0, old_keys["l0.hh.bias"])


def test_opacus_constructor_order():
    rnn = DPRNN(FEATURES, HIDDEN, 2, False, True, 0.0, True, 0, "relu")
    assert (rnn.mode, rnn.bias, rnn.batch_first, rnn.bidirectional) == ("RNN_RELU", False, True, True)
    lstm = DPLSTM(FEATURES, HIDDEN, 1, True, False, 0.0, False, PROJECTED)
    assert lstm.proj_size == PROJECTED
    with pytest.raises(TypeError, match="nonlinearity='relu'"):
        DPRNN(FEATURES, HIDDEN, 1, "relu")
    with pytest.raises(ValueError, match="proj_size"):
        DPGRU(FEATURES, HIDDEN, proj_size=1)


# ---------------------------------------------------------------------------------------- errors
def test_unbatched_input_is_refused_with_a_hint():
    wrapped = GradSampleModule(nn.GRU(FEATURES, HIDDEN))
    with pytest.raises(ValueError, match="Add a batch dimension"):
        wrapped(torch.randn(STEPS, FEATURES))


def test_wrong_initial_state_shape_names_the_state():
    wrapped = GradSampleModule(nn.LSTM(FEATURES, HIDDEN, batch_first=True))
    x = torch.randn(BATCH, STEPS, FEATURES)
    with pytest.raises(ValueError, match="c_0 has shape"):
        wrapped(x, (torch.zeros(1, BATCH, HIDDEN), torch.zeros(BATCH, 1, HIDDEN)))
    with pytest.raises(ValueError, match=r"tuple \(h_0, c_0\)"):
        wrapped(x, torch.zeros(1, BATCH, HIDDEN))


def test_dtype_mismatch_is_refused():
    wrapped = GradSampleModule(nn.RNN(FEATURES, HIDDEN, batch_first=True))
    with pytest.raises(ValueError, match="convert one of them"):
        wrapped(torch.randn(BATCH, STEPS, FEATURES, dtype=DOUBLE))


def test_second_backward_through_one_forward_is_refused():
    wrapped = GradSampleModule(nn.LSTM(FEATURES, HIDDEN, batch_first=True))
    output, _ = wrapped(torch.randn(BATCH, STEPS, FEATURES))
    output.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        output.sum().backward()


class ScaledPacked(nn.Module):
    """A root-level parameter (its own per-sample path, ``capture.root_parameters``) next to an LSTM child."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(FEATURES))
        self.lstm = nn.LSTM(FEATURES, HIDDEN, batch_first=True)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x * self.scale, lengths, batch_first=True, enforce_sorted=False)
        return self.lstm(packed)[1][0][-1]


def test_root_parameter_before_packing_is_refused_clearly():
    # Packing has no forward-mode derivative: the root parameter's tangent cannot cross it.
    wrapped = GradSampleModule(ScaledPacked())
    with pytest.raises(UnsupportedModuleError, match=r"(?s)root parameter 'scale'.*small module that owns it"):
        wrapped(torch.randn(BATCH, STEPS, FEATURES), LENGTHS)


def test_root_parameter_after_a_packed_lstm_exact():
    class PackedIntoParent(ScaledPacked):
        def forward(self, packed):
            return self.lstm(packed)[1][0][-1] * self.scale

    torch.manual_seed(0)
    model = PackedIntoParent().double()
    with torch.no_grad():
        model.scale.mul_(1.3)
    x = torch.randn(BATCH, STEPS, FEATURES, dtype=DOUBLE)
    reference = {}
    for i in range(BATCH):
        single = copy.deepcopy(model)
        single(pack_padded_sequence(x[i : i + 1], LENGTHS[i : i + 1], batch_first=True, enforce_sorted=False)).sum().backward()
        for name, param in single.named_parameters():
            reference.setdefault(name, []).append(param.grad)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    wrapped(pack_padded_sequence(x, LENGTHS, batch_first=True, enforce_sorted=False)).sum().backward()
    assert_matches_reference(model, {name: torch.stack(grads) for name, grads in reference.items()})


def test_subclass_with_its_own_forward_gets_a_hint():
    """Its forward calls the fused kernel, which cannot run under vmap: torch's error, with our note."""

    class Reversing(nn.LSTM):
        def forward(self, input, hx=None):
            output, state = super().forward(input.flip(1), hx)
            return output.flip(1), state

    wrapped = GradSampleModule(Reversing(FEATURES, HIDDEN, batch_first=True))
    with pytest.raises(RuntimeError) as raised:
        wrapped(torch.randn(BATCH, STEPS, FEATURES))
    assert "Call a plain torch layer" in "\n".join(getattr(raised.value, "__notes__", []))
