"""A plain torch implementation of XLM's PKM layer (`HashingMemoryProductFast`, facebookresearch/XLM), the peer the
benchmarks compare against.

Written from the algorithm (shared notes, section 1.4), not copied: Linear + BatchNorm1d query over all tokens, a
Python loop over heads, top-knn of each half's sub-key scores, top-knn of the knn x knn sums, fp32 softmax, and
`nn.EmbeddingBag(mode="sum")` with `per_sample_weights` (dense value gradient, as the published XLM runs: its sparse
option is broken upstream). Keys uniform(+-1/sqrt(half)), values N(0, v_dim^-1/2), as XLM.
"""

import torch
import torch.nn.functional as F
from torch import nn


class XlmProductKeyMemory(nn.Module):
    def __init__(self, input_dim=768, v_dim=768, n_keys=512, heads=4, knn=32, k_dim=256, query_batchnorm=True, sparse=False):
        super().__init__()
        self.n_keys, self.heads, self.knn, self.k_dim = n_keys, heads, knn, k_dim
        half = k_dim // 2
        self.keys = nn.Parameter(torch.empty(heads, 2, n_keys, half).uniform_(-(half**-0.5), half**-0.5))
        self.query_proj = nn.Sequential(
            nn.Linear(input_dim, heads * k_dim, bias=True),
            nn.BatchNorm1d(heads * k_dim) if query_batchnorm else nn.Identity(),
        )
        self.values = nn.EmbeddingBag(n_keys**2, v_dim, mode="sum", sparse=sparse)
        nn.init.normal_(self.values.weight, mean=0.0, std=v_dim**-0.5)

    def _get_indices(self, query, keys1, keys2):
        half = self.k_dim // 2
        q1, q2 = query[:, :half], query[:, half:]
        s1, i1 = F.linear(q1, keys1).topk(self.knn, dim=1)
        s2, i2 = F.linear(q2, keys2).topk(self.knn, dim=1)
        all_scores = (s1.view(-1, self.knn, 1) + s2.view(-1, 1, self.knn)).view(-1, self.knn * self.knn)
        all_indices = (i1.view(-1, self.knn, 1) * self.n_keys + i2.view(-1, 1, self.knn)).view(-1, self.knn * self.knn)
        scores, best = all_scores.topk(self.knn, dim=1)
        return scores, all_indices.gather(1, best)

    def forward(self, x):
        batch_shape = x.shape[:-1]
        query = self.query_proj(x.reshape(-1, x.shape[-1])).view(-1, self.heads, self.k_dim)
        results = [self._get_indices(query[:, h], self.keys[h, 0], self.keys[h, 1]) for h in range(self.heads)]
        scores = torch.stack([r[0] for r in results], 1)  # (tokens, heads, knn)
        indices = torch.stack([r[1] for r in results], 1)
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        output = self.values(indices.flatten(1), per_sample_weights=weights.flatten(1).to(self.values.weight.dtype))
        return output.view(*batch_shape, -1)
