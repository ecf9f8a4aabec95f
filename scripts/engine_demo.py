"""One greedy DFlash run on a tiny random model, one line per verify round.

No trained draft exists for a random target, so the draft is an *oracle*: the real draft
forward runs (caches and taps are exercised) but its proposals are replaced by the target's
own greedy continuation, each token corrupted with probability 0.3. Accept counts therefore
vary from 0 to B-1; the emitted text must equal plain AR greedy decoding, which is checked.
"""

import random
import sys
import tempfile
from pathlib import Path

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx
from dflash_mlx import load, stream_generate, tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.engine import PositionedDraft  # noqa: E402  (the tests' position-noting draft)

PROMPT, N, BLOCK, P_WRONG = list(b"Speculative decoding "), 40, 5, 0.3


class OracleDraft(PositionedDraft):
    """The real forward runs (cache bookkeeping); the proposal head peaks at the oracle's ids."""

    def proposal_logits(self, hidden):
        ids = [REF[j] if 0 <= (j := self.pos + i - len(PROMPT)) < len(REF) else 0
               for i in range(1, hidden.shape[-2] + 1)]
        ids = [RNG.randrange(tiny.VOCAB_SIZE) if RNG.random() < P_WRONG else t for t in ids]
        peak = mx.arange(self.config.vocab_size) == mx.array(ids)[:, None]
        return mx.where(peak, 0.0, -1e9).reshape(*hidden.shape[:-1], -1)


root = Path(tempfile.mkdtemp(prefix="dflash-demo-"))
pair = load(tiny.make_target(root / "t"), tiny.make_draft(root / "d"), draft_bits=16,
            weights="float32")
pair.tokenizer._eos_token_ids = set()  # random weights: let it run the full length
REF = [t for e in stream_generate(pair, PROMPT, block_size=1, max_tokens=N) for t in e.tokens]
RNG = random.Random(0)
oracle = OracleDraft(pair.draft.config)
oracle.update(pair.draft.parameters())
pair.draft = oracle.bind(pair.target)
print(f"{'round':>5}  {'drafted ids':<28} {'acc':>3}  emitted ids")
out = []
# lookup off: the oracle's blocks are verified as proposed
for r, ev in enumerate(stream_generate(pair, PROMPT, block_size=BLOCK, max_tokens=N, lookup=False)):
    out += ev.tokens
    print(f"{r:>5}  {str(ev.drafted):<28} {ev.accepted:>3}  {ev.tokens}")
print(f"{len(out)} tokens in {r + 1} rounds (τ = {len(out) / (r + 1):.2f}); "
      f"identical to AR greedy: {out == REF}")
sys.exit(0 if out == REF else 1)
