"""The fixed pieces of Python a written module may carry (``autopar.passes.export.source``
puts in those its layout needs): a layout of a module torch's parallel styles do not take, a
hidden state split on entry to the layers, a rank's rows of a batch, a pipeline stage that runs
the model's own forward with only its layers, and the sum of a tied parameter's gradients over
the stages that hold a copy. Each is text, written as it stands; none is run here.
"""

DISTRIBUTE_AS_PLANNED = '''
def distribute_as_planned(module: nn.Module, mesh: DeviceMesh, params: dict, *, arrives, reads, leaves) -> None:
    """Lay out a module torch's parallel styles do not take as the plan does: its parameters as
    DTensors with the plan's placements; its input, which ``arrives`` placed so, moved to what its
    first op ``reads``; its output handed on as ``leaves`` says, as a local tensor."""

    def place(name, submodule, mesh):
        for pname, param in list(submodule.named_parameters(recurse=False)):
            placement = params.get(f"{name}.{pname}" if name else pname, Replicate())
            submodule.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement])))

    def take(submodule, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [arrives], run_check=False).redistribute(mesh, [reads])
                     if isinstance(x, torch.Tensor) else x for x in inputs)

    def hand_on(submodule, output, mesh):
        return output.redistribute(mesh, [leaves]).to_local()

    distribute_module(module, mesh, place, take, hand_on)
'''

SPLIT_ON_ENTRY = '''
def split_on_entry(layer: nn.Module, mesh: DeviceMesh, placement) -> None:
    """Split the hidden state (the layer's first argument, whole until here) as ``placement`` says on
    entering ``layer``: the model's own Python before its layers reads the shapes of what it makes
    (positions, masks), so the split the plan makes earlier starts here."""

    def split(module, args):
        hidden = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False).redistribute(mesh, [placement])
        return (hidden.to_local(), *args[1:])

    layer.register_forward_pre_hook(split)
'''

LOCAL_BATCH = '''
def local_batch(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's rows of a whole batch: split over BATCH_AXES, outermost first, as the plan splits it."""
    for name in BATCH_AXES:
        tensor = tensor.tensor_split(mesh[name].size())[mesh[name].get_local_rank()]
    return tensor
'''

STAGE_CLASSES = '''
class SkippedLayer(nn.Module):
    """A layer another stage runs: hands the hidden state on."""

    def forward(self, hidden, *args, **kwargs):
        return hidden


class _Leave(Exception):
    """Ends a stage's forward at its last layer, carrying that layer's output."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden


def _leave(module, args, output):
    raise _Leave(output)


class Stage(nn.Module):
    """Pipeline stage ``index``: the model's own forward, running only its layers (STAGE_LAYERS;
    the others skipped). The hidden state from the previous stage enters its first layer (a layer's
    first positional argument), and its last layer's output leaves for the next stage. Its forward
    runs the model's ops before the layers on every stage (they make what layers read besides the
    hidden state: positions, masks); only the first stage trains them (STAGE_TRAINS)."""

    def __init__(self, model: nn.Module, index: int):
        super().__init__()
        self.model, self.index = model, index
        first, last = STAGE_LAYERS[index]
        layers = model.get_submodule(LAYERS)
        for i in range(len(layers)):
            if not first <= i < last:
                layers[i] = SkippedLayer()
        trained = [LAYERS, *STAGE_TRAINS[index]]
        for name, param in model.named_parameters(remove_duplicate=False):
            param.requires_grad_(False)
        for name, param in model.named_parameters(remove_duplicate=False):
            if any(name.startswith(path + ".") for path in trained):
                param.requires_grad_(True)

    def forward(self, *received, **inputs):
        layers = self.model.get_submodule(LAYERS)
        first, last = STAGE_LAYERS[self.index]
        hooks = []
        if self.index > 0:  # the previous stage's hidden state replaces what the model made
            hooks.append(layers[first].register_forward_pre_hook(lambda module, args: (received[0], *args[1:])))
        if self.index < NUM_STAGES - 1:
            hooks.append(layers[last - 1].register_forward_hook(_leave))
        try:
            output = self.model(**inputs)
        except _Leave as leave:
            return leave.hidden
        finally:
            for hook in hooks:
                hook.remove()
        return output if isinstance(output, torch.Tensor) else output[0]
'''

SUM_TIED = '''
def sum_tied_gradients(stages: list, mesh: DeviceMesh) -> None:
    """Sum the gradients of the parameters two stages use (TIED_ACROSS_STAGES, e.g. a tied embedding
    and head) over the pipeline axis: each stage holds a copy, and torch's pipelining keeps them apart.
    Call after ``schedule.step``, before ``optimizer.step``."""
    for name in TIED_ACROSS_STAGES:
        params = [stage.submod.model.get_parameter(name) for stage in stages]
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in params)]
        total = sum((g if g is not None else torch.zeros_like(t)) for g, t in zip(grads, local))
        dist.all_reduce(total, group=mesh["PIPELINE_AXIS"].get_group())
        for grad in grads:
            if grad is not None:
                grad.copy_(total)
'''
