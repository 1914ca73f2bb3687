r"""Export a shipped trained model as a release-format checkpoint directory, so the text / chat path
(`load_pretrained`, `generate_text`, `serve --checkpoint`) can be tried on a model that knows something.

    python -m experiments.export_checkpoint --model=v4_retrieval --out=/tmp/v4_retrieval_hf
    python -m experiments.serve --checkpoint=/tmp/v4_retrieval_hf --requests=reqs.jsonl

The directory holds what a downloaded checkpoint holds:
* `config.json`: V4 in transformers' DeepseekV4Config format (V4.1: NeMo's "deepseek_v41_text" text config);
  dsv4.loading.config_json.config_to_dict;
* `model.safetensors`: float32 (the trained weights, bit for bit) in transformers naming (V4.1: NeMo naming);
* `tokenizer.json` + `tokenizer_config.json`: a word-level tokenizer for the 64-token task vocabulary
  (experiments/tasks.py) with readable names: "<bos>" 0, "<eos>" 1 (config eos, never trained), "<sep>" 2,
  filler "f3".."f7", keys "k8".."k39", values "v40".."v63" (count answers for v4_count). Words are split on
  whitespace; the post-processor prepends "<bos>" to plain text (transformers 5.x style); a word outside the
  vocabulary is an encode error (every id is a task token, there is no <unk>).

Chat template: messages render as the task's sequence. A "system" message is the document; the first user /
assistant message after it is preceded by "<sep>"; every message's content follows, space separated. So

    [{"role": "system", "content": "f3 k12 v50 f4 ..."}, {"role": "user", "content": "k12"}]
    -> "<bos> f3 k12 v50 f4 ... <sep> k12"                              (the model answers "v50")

and answered turns continue it like the task's query section ("... <sep> k12 v50 k9" asks the next key). Without a
system message the contents are written as they are (one user message may hold "document <sep> key"). The plain
text prompt "f3 k12 v50 f4 ... <sep> k12" gives the same ids.

V4.1 models load with NeMo's quantized cache on by default (every NeMo-format config does); pass
`load_pretrained(dir, quantized_cache=False)` to run the model exactly as it was trained.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags, logging
from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers, processors

from dsv4.loading.config_json import config_to_dict
from dsv4.loading.safetensors_write import save_checkpoint
from dsv4.loading.tokenizer import Tokenizer
from experiments import tasks, train_lib

CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(doc=false, sep=false) %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.doc = true %}{{ ' ' + m['content'] }}"
    "{% elif m['role'] in ['user', 'assistant'] %}{% if ns.doc and not ns.sep %}{% set ns.sep = true %}"
    "{{ ' <sep>' }}{% endif %}{{ ' ' + m['content'] }}"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}")


def token_names(vocab_size: int, spec=None, eos_token_id: int = 1) -> list[str]:
  """Readable word per id of the task vocabulary (see the module doc)."""
  spec = spec if spec is not None else tasks.KVRecallSpec()
  names = []
  for i in range(vocab_size):
    if i == tasks.BOS:
      names.append("<bos>")
    elif i == tasks.SEP:
      names.append("<sep>")
    elif i == eos_token_id:
      names.append("<eos>")
    elif spec.filler_lo <= i < spec.filler_hi:
      names.append(f"f{i}")
    elif spec.key_lo <= i < spec.key_hi:
      names.append(f"k{i}")
    elif i >= spec.key_hi:
      names.append(f"v{i}")
    else:
      names.append(f"t{i}")
  return names


def task_tokenizer(vocab_size: int, spec=None, eos_token_id: int = 1):
  """dsv4.loading.Tokenizer for the task vocabulary: WordLevel over `token_names`, whitespace pre-tokenizer,
  "<bos>" / "<eos>" / "<sep>" as special tokens, BOS added by the post-processor, the chat template above."""
  names = token_names(vocab_size, spec, eos_token_id)
  b = Backend(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token=None))
  b.pre_tokenizer = pre_tokenizers.WhitespaceSplit()   # "<sep>" etc. stay whole words even when not special
  b.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with single spaces
  specials = [w for w in names if w.startswith("<")]
  b.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in specials])
  b.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B:1",
                                                   special_tokens=[("<bos>", names.index("<bos>"))])
  return Tokenizer(b, bos_token="<bos>", eos_token=names[eos_token_id], chat_template=CHAT_TEMPLATE)


def export(model: str, out: str, *, force: bool = False, shard_bytes: int | None = None) -> str:
  """Write the release-format directory `out` for the shipped model `model` (a name under experiments/checkpoints
  or a directory written by experiments.train). Returns `out`."""
  directory = model if os.path.isdir(model) else os.path.join(train_lib.CHECKPOINT_ROOT, model)
  if not os.path.isdir(directory):
    shipped = sorted(os.listdir(train_lib.CHECKPOINT_ROOT))
    raise FileNotFoundError(f"{directory}: no such checkpoint (shipped: {shipped})")
  if os.path.isdir(out) and os.listdir(out) and not force:
    raise FileExistsError(f"{out}: exists and is not empty (--force overwrites)")
  config, params, info = train_lib.load_checkpoint_dir(directory)
  spec = train_lib.task_spec_from_info(info) if "task" in info else tasks.KVRecallSpec()
  os.makedirs(out, exist_ok=True)
  for fn in os.listdir(out):  # with force: no shard of an earlier export may outlive this one
    if fn.endswith((".safetensors", ".safetensors.index.json")):
      os.remove(os.path.join(out, fn))
  save_checkpoint(params, config, out, naming="hf" if config.variant == "v4" else "nemo", shard_bytes=shard_bytes,
                  dtype=np.float32)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config_to_dict(config, dtype="float32"), f, indent=1)
  task_tokenizer(config.vocab_size, spec, config.eos_token_id).save(out)
  return out


FLAGS = flags.FLAGS


def define_flags():
  """Defined only when this module is the program (importing `export` defines nothing: no clash with serve's)."""
  flags.DEFINE_string("model", "v4_retrieval", "Shipped model under experiments/checkpoints/ (v4_retrieval, v4_count, "
                      "v41_retrieval) or a directory written by experiments.train.")
  flags.DEFINE_string("out", "", "Output directory.")
  flags.DEFINE_bool("force", False, "Overwrite a non-empty --out.")
  flags.DEFINE_integer("shard_bytes", 0, "Split the weights into shards of about this many bytes (+ index); 0: one file.")


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)   # orbax logs INFO lines on every restore
  if not FLAGS.out:
    raise app.UsageError("--out=DIR is required")
  try:
    out = export(FLAGS.model, FLAGS.out, force=FLAGS.force, shard_bytes=FLAGS.shard_bytes or None)
  except (FileNotFoundError, FileExistsError) as e:
    raise SystemExit(f"export_checkpoint: {e}") from e
  print(f"wrote {out}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
