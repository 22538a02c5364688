"""Your own OPD loop with the public step: explicit components, no config file. Same seed and settings as
`opdjax train student=S teacher=T` -> the same per-step losses and held-out reverse KL (tests/examples checks it).

    python examples/own_opd_loop.py STUDENT_DIR TEACHER_DIR [STEPS]   (HF dirs sharing one tokenizer)
"""
import sys

import opdjax
from opdjax.models import hf
from opdjax.models.sharding import make_mesh
from opdjax.models.tiny import load_tokenizer
from opdjax.pipeline.opd import rollout_seed

D = opdjax.TrainConfig()  # the library's default hyper-parameters (their one source), read, not a config file


def main(student: str, teacher: str, steps: int = 20, seed: int = 0, task=None, batch_size: int = D.rollout.batch_size,
         eval_prompts: int = D.pipeline.eval_prompts, log=print) -> list[dict]:
    tok, cfg, mesh = load_tokenizer(student), opdjax.load_config(student), make_mesh(D.mesh.shape)
    graphdef, params = hf.load_state(student, cfg)
    o, n = D.optim, D.rollout.max_new_tokens
    tx, schedule = opdjax.make_optimizer(lr=o.lr, total_steps=steps, warmup_steps=o.warmup_steps,
                                         grad_clip=o.grad_clip, b1=o.b1, b2=o.b2)
    engine = opdjax.JaxEngine(cfg, params, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    publisher, link = opdjax.engine_publisher(engine, cfg)
    parts = opdjax.OPDParts(engine=engine, teacher=opdjax.JaxTeacher.from_pretrained(teacher, mesh=mesh),
                            learner=opdjax.Learner(graphdef, tx=tx, schedule=schedule, temperature=1.0, mesh=mesh),
                            publisher=publisher, tokenizer=tok,
                            sampling=opdjax.SamplingParams(max_new_tokens=n, stop_token_ids=(tok.eos_token_id,)))
    task = task or opdjax.get_task(D.task.name, **D.task.options)
    held_out = opdjax.Evaluator.held_out(task, eval_prompts, D.pipeline.eval_seed)
    evaluate = opdjax.Evaluator(opdjax.JaxEngine(cfg, None, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id),
                                parts.teacher, tok, held_out, model_cfg=cfg, max_new_tokens=n, task=task)
    stream, state, history = opdjax.PromptStream(task, seed=seed), parts.learner.init(params), []
    log(f"step 0: {evaluate(state.params, 0)}")
    for step in range(steps):
        state, m = opdjax.opd_step(parts, state, stream.next(batch_size), seed=rollout_seed(seed, step))
        history.append(m)
    history[-1].update(evaluate(state.params, steps))
    log(f"step {steps}: loss {history[-1]['loss']:.4f}, held-out reverse KL {history[-1]['eval/reverse_kl']:.3f}")
    link.close()
    return history


if __name__ == "__main__":
    if not 3 <= len(sys.argv) <= 4 or not all(a.isdigit() for a in sys.argv[3:]):
        sys.exit("usage: python examples/own_opd_loop.py STUDENT_DIR TEACHER_DIR [STEPS]   (HF dirs, one tokenizer)")
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:4]))
