"""Config -> a typed `Run`, in one place: the input checked and the models resolved (`pipeline.inputs`), the
student loaded, each component made from its section (`pipeline.components`), the publisher's link kept to close.
"""

from __future__ import annotations

import dataclasses
import pathlib
import secrets
import socket

import jax
from flax import nnx
from jax.sharding import Mesh

from opdjax.config import TrainConfig
from opdjax.learner.distributed import from_first
from opdjax.models import ModelConfig, hf
from opdjax.models.sharding import make_mesh
from opdjax.models.tiny import load_tokenizer
from opdjax.pipeline import components, inputs
from opdjax.pipeline.evaluate import Evaluator
from opdjax.pipeline.opd import OPDParts, publish
from opdjax.remote.lease import RunId
from opdjax.rollout.jax_engine import JaxEngine
from opdjax.sync import Link
from opdjax.teacher import check_same_vocab

__all__ = ["Run", "build", "identity", "make_evaluator"]


@dataclasses.dataclass
class Run:
    """Everything one training run holds: the OPD components, what `pipeline.opd` steps on, read as
    `run.parts.engine`, `run.parts.teacher` (None when built with_teacher=False) and so on; and what the loop needs
    besides (the config, the model, the mesh, the run directory, the links to close)."""

    cfg: TrainConfig
    parts: OPDParts
    student_cfg: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State                # the student's initial weights
    mesh: Mesh
    out_dir: pathlib.Path
    links: list[Link] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        """Release what the run opened for publishing (sockets, snapshot directories) and free the engine servers it
        bound (process 0 frees them; the others leave that to it)."""
        for link in self.links:
            link.close()
        self.links.clear()
        for part in (self.parts.engine, self.parts.teacher):
            if getattr(part, "shared", False):
                part.close(release=jax.process_index() == 0)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def identity(cfg: TrainConfig, run: str | None = None) -> RunId:
    """This launch as engine servers know it (`remote.lease`): `run` (a new id when None) and a new session, process
    0's on every process; labelled host:out_dir; `sync.takeover` as set."""
    text = f"{run or secrets.token_hex(8)} {secrets.token_hex(8)}" if jax.process_index() == 0 else ""
    run_id, session = from_first(text).split()
    label = f"{socket.gethostname()}:{pathlib.Path(cfg.pipeline.out_dir).resolve()}"
    return RunId(run=run_id, session=session, label=label, takeover=cfg.sync.takeover)


def build(cfg: TrainConfig, log=print, *, with_teacher: bool = True, checked: inputs.Inputs | None = None,
          run_id: RunId | None = None, publish_start: bool = True) -> Run:
    """Everything a run needs; `with_teacher=False` skips loading the teacher (probes only rescore the student).

    What can be checked without the models is checked first (`inputs.check_inputs`), unless the caller passes what
    that check returned for this `cfg` (`checked`: `opdjax train` checks before it claims its run directory, and the
    prompt file is read once). Engine servers are bound to `run_id` (default: a new `identity`); with
    `publish_start`, the student's starting weights are published to them as version 0 before anything samples
    (the training loop publishes its own starting point, a checkpoint's when it resumes)."""
    checked = checked or inputs.check_inputs(cfg)
    run_id = run_id or identity(cfg)
    mesh, task = checked.mesh, checked.task
    student_path, teacher_path = inputs.resolve_models(cfg, log)
    tokenizer = load_tokenizer(student_path)
    try:
        teacher_tok = load_tokenizer(teacher_path)
    except (OSError, ValueError):
        teacher_tok = None
    # The usable vocabulary (padding rows beyond the tokenizer dropped) and every stop id, from the tokenizer.
    student_cfg = ModelConfig.from_dir(student_path).with_tokenizer(tokenizer)
    check_same_vocab(student_cfg, ModelConfig.from_dir(teacher_path), tokenizer, teacher_tok)
    inputs.check_chat_templates(cfg, task, tokenizer, teacher_tok)
    inputs.check_lengths(cfg, task, tokenizer, student_cfg.max_position_embeddings)
    student = cfg.student
    graphdef, params = hf.load_state(student_path, student_cfg, param_dtype=student.dtype,
                                     dtype=student.compute_dtype, attention=student.attention, remat=student.remat)
    sampling = components.sampling_params(cfg, student_cfg)
    learner = components.make_learner(cfg, graphdef, mesh, sampling)
    engine = components.make_engine(cfg, student_path, student_cfg, params, tokenizer, run_id=run_id)
    # Several learner processes: each scores its own rows, so an in-process teacher lives on its local devices.
    teacher_mesh = mesh if jax.process_count() == 1 else make_mesh((1, -1, 1), jax.local_devices())
    publisher, link = components.make_publisher(cfg, student_cfg, engine)
    parts = OPDParts(engine=engine, learner=learner, publisher=publisher, tokenizer=tokenizer, sampling=sampling,
                     teacher=(components.make_teacher(cfg, teacher_path, teacher_mesh, student_cfg.usable_vocab,
                                                      run_id=run_id) if with_teacher else None),
                     samples_per_prompt=cfg.rollout.samples_per_prompt, teacher_top_k=cfg.teacher.top_k, task=task)
    run = Run(cfg=cfg, parts=parts, student_cfg=student_cfg, graphdef=graphdef, params=params, mesh=mesh,
              out_dir=pathlib.Path(cfg.pipeline.out_dir), links=[link])
    if publish_start and getattr(engine, "shared", False):
        publish(parts, params, 0)
    return run


def make_evaluator(run: Run) -> Evaluator:
    """The held-out evaluator of a run: `pipeline.eval_prompts` held-out examples drawn with `pipeline.eval_seed` (the
    same set for every run seed, so seeds are compared on the same prompts), sampled by a
    clean JAX engine (no quantization, noise or staleness), scored by the run's teacher."""
    cfg, p = run.cfg, run.parts
    tok = p.tokenizer
    engine = JaxEngine(run.student_cfg, None, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    return Evaluator(engine, p.teacher, tok, Evaluator.held_out(p.task, cfg.pipeline.eval_prompts,
                                                                cfg.pipeline.eval_seed),
                     model_cfg=run.student_cfg, max_new_tokens=cfg.rollout.max_new_tokens, task=p.task,
                     stop_token_ids=p.sampling.stop_token_ids)


