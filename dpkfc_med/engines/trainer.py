"""The private trainer: a MONAI ``SupervisedTrainer`` whose iteration is one private step.

One iteration takes one Poisson-sampled batch of privacy units (the data loader the
:class:`~dpkfc_med.privacy.engine.PrivacyEngine` made), runs the forward pass, backpropagates
the *sum* of per-sample losses (so each sample's error is its own loss gradient whatever the
batch size; the optimizer divides the noised sum by the expected batch), tells the optimizer
which unit each sample belongs to (several crops or images of one patient are summed before
clipping) and takes the scale-then-privatize step: preconditioning, per-unit clipping, noise,
ledger. An empty Poisson batch still takes its noisy step (:func:`noise_only_step`).

Everything around the step is a handler (``dpkfc_med.engines.handlers``), attached like any
MONAI or Ignite handler; MONAI's own handlers (``StatsHandler``, ``CheckpointSaver``,
``ValidationHandler``, ...) attach unchanged. Without a privacy engine the trainer runs the same
loop non-privately (batch-mean loss, plain optimizer step).

Stops: Ctrl-C, SIGTERM (turned into ``KeyboardInterrupt``) or an error fire
:attr:`PrivacyEvents.RUN_STOPPED` before the exception leaves :meth:`PrivateTrainer.run`, so the
checkpoint and report handlers record what was spent whatever other handlers do with Ignite's
``EXCEPTION_RAISED``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from ignite.engine import EventEnum
from monai.engines import SupervisedTrainer
from monai.engines.utils import IterationEvents
from monai.utils.enums import CommonKeys as Keys
from torch import Tensor, nn

from dpkfc_med.engines.precision import Precision, forward_autocast

__all__ = [
    "PrivacyEvents",
    "PrivateTrainer",
    "RunInterrupted",
    "float32_output",
    "noise_only_step",
    "sigterm_as_interrupt",
    "unwrapped",
]

Unpack = Callable[[Any], tuple[Tensor, Tensor, Tensor | None]]


class PrivacyEvents(EventEnum):
    """Events of the private trainer (besides Ignite's and MONAI's iteration events)."""

    RUN_STOPPED = "run_stopped"
    """Fired when an interrupt or an error stops the run; ``engine.state.stop_error`` holds it."""


class RunInterrupted(KeyboardInterrupt):
    """Training was interrupted (Ctrl-C, SIGTERM); the message says what was spent, what next."""


def _tuple_unpack(batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    return batch[0], batch[1], (batch[2] if len(batch) > 2 else None)


def float32_output(out: Any) -> Any:
    """A network output (tensor, or tuple/list of them) with low-precision floats in float32."""
    if isinstance(out, Tensor):
        return out.float() if out.is_floating_point() and out.dtype != torch.float64 else out
    if isinstance(out, (tuple, list)):
        return type(out)(float32_output(o) for o in out)
    return out


def unwrapped(network: nn.Module) -> nn.Module:
    """The network inside Opacus' ``GradSampleModule`` (itself when not wrapped)."""
    return getattr(network, "_module", network)


def noise_only_step(popt: Any) -> None:
    """Take the noisy step of an empty Poisson batch: zero clipped sum, full noise, one ledger step.

    An empty batch is part of the sampled mechanism and must still be noised and accounted.
    No forward/backward pass runs: per-sample gradient hooks of some layers (those Opacus
    computes with ``functorch.vmap``, e.g. ``PReLU``) cannot take a batch of zero samples, so
    every parameter is given an empty per-sample gradient ``[0, *shape]`` directly.
    """
    for p in popt.params:
        p.grad_sample = p.new_zeros((0, *p.shape))
    popt.step()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM (a scheduler's kill) into KeyboardInterrupt, so it checkpoints too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _in_order(chunks: list[Tensor], preds: list[Tensor]) -> Tensor:
    """The chunks' predictions ``preds[i]`` (rows ``chunks[i]``) in the batch's row order."""
    first = preds[0]
    rows = torch.cat(chunks).to(first.device)
    full = torch.empty((len(rows), *first.shape[1:]), dtype=first.dtype, device=first.device)
    full[rows] = torch.cat(preds)
    return full


class PrivateTrainer(SupervisedTrainer):
    """MONAI ``SupervisedTrainer`` taking one private step per iteration.

    Args:
        device: Where the network runs.
        max_epochs: Epochs of ``epoch_length`` iterations each (the plan's epochs).
        train_data_loader: The private loader (Poisson sampling of units) from
            :meth:`~dpkfc_med.privacy.engine.PrivacyEngine.make_private`, or any loader for a
            non-private run.
        network: The network (wrapped for per-sample gradients when private).
        optimizer: The private optimizer (scale, clip, noise, ledger), or a plain one.
        per_sample_loss: ``loss(outputs, targets) -> Tensor[B]``, one loss per sample.
        privacy_engine: The engine that made the mechanism; ``None`` trains non-privately.
        unpack: ``batch -> (images [B, C, *S], targets, unit ids [B] or None)``; defaults to
            tuples ``(x, y[, units])``.
        precision: The forward pass's precision (``bf16``/``fp16`` autocast on CUDA).
        epoch_length: Iterations per epoch (default ``len(train_data_loader)``).
        train_handlers: Handlers with an ``attach(engine)`` method.
        decollate: Split ``engine.state.output`` into per-sample dictionaries after each step,
            as MONAI's trainers do by default (a bundle's handlers expect it); the step's mean
            loss and sample count are always in ``engine.state.step_loss`` / ``step_samples``.
        max_physical_batch: The most privacy units one forward/backward pass holds (``None``:
            the whole Poisson batch). A larger batch runs in chunks of whole units: each chunk's
            transformed, per-unit clipped gradients are added to the step's sum, and the noise
            and the update follow the last chunk once, so the mechanism is the same and the
            memory that of one chunk.
        **kwargs: Passed to ``SupervisedTrainer`` (``inferer``, ``key_train_metric``, ...).
    """

    def __init__(
        self,
        device: str | torch.device,
        max_epochs: int,
        train_data_loader: Any,
        network: nn.Module,
        optimizer: Any,
        per_sample_loss: Callable[[Any, Tensor], Tensor],
        *,
        privacy_engine: Any = None,
        unpack: Unpack | None = None,
        precision: Precision = Precision.FLOAT32,
        epoch_length: int | None = None,
        train_handlers: Sequence[Any] | None = None,
        decollate: bool = False,
        max_physical_batch: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            device=device,
            max_epochs=max_epochs,
            train_data_loader=train_data_loader,
            network=network,
            optimizer=optimizer,
            loss_function=per_sample_loss,
            epoch_length=epoch_length,
            decollate=decollate,
            optim_set_to_none=True,
            event_names=[PrivacyEvents],
            **kwargs,
        )
        # Ignite's own messages go to the run's log, not the console the progress bar owns.
        self.logger = logging.getLogger("dpkfc_med.engine")
        self.privacy_engine = privacy_engine
        self.unpack = unpack or _tuple_unpack
        self.precision = precision
        if max_physical_batch is not None and max_physical_batch < 1:
            raise ValueError(f"max_physical_batch={max_physical_batch} must be >= 1 or None")
        self.max_physical_batch = max_physical_batch
        self.decollated = decollate
        self.nonprivate_steps = 0  # steps of a non-private run (the private ones: the ledger)
        self.state.stop_error = None
        self.state.step_loss = float("nan")  # the last step's mean per-sample loss
        self.state.step_samples = 0  # and its number of samples (crops, images)
        if train_handlers:
            self._register_handlers(train_handlers)

    @property
    def private(self) -> bool:
        """Whether the steps are private (a privacy engine made the optimizer)."""
        return self.privacy_engine is not None

    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken so far, earlier runs of a resumed run included."""
        if self.private:
            return int(self.optimizer.steps_taken)  # type: ignore[attr-defined]
        return self.nonprivate_steps

    def _iteration(self, engine: Any, batchdata: Any) -> dict[str, Any]:
        x, y, units = self.unpack(batchdata)
        device = self.state.device
        x, y = x.to(device, non_blocking=self.non_blocking), y.to(device)
        output: dict[str, Any] = {Keys.IMAGE: x, Keys.LABEL: y}
        self.state.output = output
        self.network.train()
        self.optimizer.zero_grad(set_to_none=True)
        ran = len(x) > 0
        if not ran:  # no model ran: no model events (and nothing to decollate)
            output[Keys.LOSS] = torch.tensor(float("nan"))
            if self.private:
                noise_only_step(self.optimizer)
        else:
            chunks = self._unit_chunks(units, len(x))
            chunk_preds: list[Tensor] = []
            chunk_losses: list[Tensor] = []
            if len(chunks) > 1:
                chunk_preds, chunk_losses = self._accumulate_chunks(x, y, units, chunks[:-1])
                last = chunks[-1]
                x_last, y_last = x[last], y[last]
                units_last = units[last] if units is not None else None
            else:
                x_last, y_last, units_last = x, y, units
            with forward_autocast(self.precision, device):
                pred = self.inferer(x_last, self.network)
            output[Keys.PRED] = (
                pred if len(chunks) == 1 else _in_order(chunks, [*chunk_preds, pred.detach()])
            )
            self.fire_event(IterationEvents.FORWARD_COMPLETED)
            per_sample = self.loss_function(float32_output(pred), y_last)
            losses = [*chunk_losses, per_sample.detach()]
            output[Keys.LOSS] = torch.cat([loss.reshape(-1) for loss in losses]).mean()
            self.fire_event(IterationEvents.LOSS_COMPLETED)
            # private: the sum, so each sample's error is its own loss gradient (the optimizer
            # averages the noised sum over the expected batch: backward_reduction="sum"); a
            # batch mean would round (1/B) g under bf16 and make the step depend on B
            (per_sample.sum() if self.private else per_sample.mean()).backward()
            self.fire_event(IterationEvents.BACKWARD_COMPLETED)
            if units_last is not None and self.private:
                self.optimizer.set_unit_ids(units_last.to(device))  # type: ignore[attr-defined]
            self.optimizer.step()
        if not self.private:
            self.nonprivate_steps += 1
        self.state.step_loss = float(output[Keys.LOSS])
        self.state.step_samples = len(x)
        if ran:
            self.fire_event(IterationEvents.MODEL_COMPLETED)
        elif self.decollated:  # the per-sample form handlers read: one entry, its loss nan
            self.state.output = [{Keys.LOSS: output[Keys.LOSS]}]
        return self.state.output  # decollated by MONAI at MODEL_COMPLETED when asked

    def _unit_chunks(self, units: Tensor | None, n: int) -> list[Tensor]:
        """Row indices of each chunk of at most ``max_physical_batch`` whole units."""
        limit = self.max_physical_batch
        if not self.private or limit is None:
            return [torch.arange(n)]
        ids = units.cpu() if units is not None else torch.arange(n)
        distinct = torch.unique(ids)
        if len(distinct) <= limit:
            return [torch.arange(n)]
        return [torch.isin(ids, group).nonzero().squeeze(1) for group in distinct.split(limit)]

    def _accumulate_chunks(
        self, x: Tensor, y: Tensor, units: Tensor | None, chunks: list[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Add each chunk's transformed, per-unit clipped gradients to the step's sum.

        Opacus' skip signal makes the optimizer clip and accumulate without noise or update;
        ``zero_grad`` after a skipped step keeps the accumulated sum (``summed_grad``).

        Returns:
            Each chunk's predictions and per-sample losses, detached.
        """
        device = x.device
        preds, losses = [], []
        for rows in chunks:
            with forward_autocast(self.precision, device):
                pred = self.inferer(x[rows], self.network)
            per_sample = self.loss_function(float32_output(pred), y[rows])
            per_sample.sum().backward()
            if units is not None:
                self.optimizer.set_unit_ids(units[rows].to(device))  # type: ignore[attr-defined]
            self.optimizer.signal_skip_step(do_skip=True)  # type: ignore[attr-defined]
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            preds.append(pred.detach())
            losses.append(per_sample.detach())
        return preds, losses

    def run(self) -> None:  # type: ignore[override]
        """Train; on an interrupt or error fire :attr:`PrivacyEvents.RUN_STOPPED`, then raise."""
        try:
            with sigterm_as_interrupt():
                super().run()
        except BaseException as err:
            self.state.stop_error = err
            try:
                self.fire_event(PrivacyEvents.RUN_STOPPED)
            except Exception:  # never hide the error that stopped the run
                logging.getLogger("dpkfc_med").exception("recording the stopped run failed")
            raise
