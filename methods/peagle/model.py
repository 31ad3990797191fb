"""P-EAGLE drafter: EAGLE-3's drafter drafting several tokens in one forward, through mask slots.

    python -m train recipes/tiny/peagle.yaml      # trains PeagleDrafter from feature shards (layers 1, 2, 3, -1)

Training: as `methods.eagle3.model.Eagle3Drafter` (draft vocabulary, `drafter(batch)` returns the unrolled loss), with
`parallel_tokens` unrolled steps whose steps 1.. read the mask slot's inputs. Drafting (`eval.proposers`'
`ParallelProposer`): one `step(...)` over the new real positions followed by `parallel_tokens - 1` mask slots, whose
`inputs` are `mask_hidden` and whose tokens are `cfg.mask_token_id`; the final-norm output of the last real position
and of each mask slot gives one depth's logits over the draft vocabulary (`draft_ids` maps them to target ids).
"""

from __future__ import annotations

import torch
from torch import nn

from methods.eagle3.model import Eagle3Drafter
from methods.peagle.config import PeagleConfig
from models.common import TargetParts


class PeagleDrafter(Eagle3Drafter):
    """P-EAGLE (parallel EAGLE: an EAGLE-3 drafter that drafts K tokens in one forward pass).

    The real positions are EAGLE-3's first draft step: at position t the fused target features f_t and the
    embedding of x_{t+1}. After the last real position p, K-1 mask slots follow at positions p+1 .. p+K-1; each reads
    the learned vector `mask_hidden` (the size of fc's input, n_feat·d, through the same FC-Norm and fc as target
    features) and the target's frozen embedding of `mask_token_id`. Attention is causal: mask slot j sees the real
    prefix and mask slots 1..j. The last real position predicts x_{p+2}, mask slot j predicts x_{p+j+2}.

    Training is EAGLE-3's training-time test (`Eagle3Drafter.unroll`: step j at anchor t attends to the real keys up
    to t and to its own steps 1..j at t, in checkpointed blocks) with `parallel_tokens` steps, steps j >= 1 reading
    the mask slot's inputs instead of the step before's output; step j's loss targets x_{t+j+2}, weighted
    step_decay**j.
    """

    def __init__(self, cfg: PeagleConfig, target: TargetParts):
        super().__init__(cfg, target)
        n_feat, d = len(self.cfg.feature_layers), target.config.hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(n_feat * d) * target.config.initializer_range)  # (n_feat·d,)

    def mask_inputs(self, B: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """n mask slots' inputs for B rows: the mask token's embedding and fc(FC-Norm(mask_hidden)), (B, n, d) each."""
        n_feat = len(self.cfg.feature_layers)
        g = self.fuse_features(self.mask_hidden.to(self.compute_dtype).view(1, 1, n_feat, -1))  # (1, 1, d)
        ids = torch.full((1, 1), self.cfg.mask_token_id, dtype=torch.long, device=g.device)
        emb = self.embed_tokens(ids).to(g.dtype)  # (1, 1, d)
        return emb.expand(B, n, -1), g.expand(B, n, -1)

    def unrolled_inputs(self, j: int, ids: torch.Tensor, fed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0: EAGLE-3's (x_{t+1}'s embedding, the fused target features); step j >= 1: mask slot j's."""
        if j == 0:
            return super().unrolled_inputs(j, ids, fed)
        return self.mask_inputs(*ids.shape)
