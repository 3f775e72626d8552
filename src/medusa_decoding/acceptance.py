"""Acceptance rules: which of the tree's candidates the base model keeps. Pure functions.

Glossary: N tree nodes (root first), V vocabulary, A accepted nodes (root included),
P paths, L path length, C children of one node.
Vocabulary (as vLLM's rejection sampler): the tokens a step emits are the accepted candidates
(the tree nodes after the root on the accepted path) followed by one more token, the bonus
token, drawn from p at the last accepted node. The root itself was the previous step's bonus.
`p` is the target (base) distribution, `q` the draft distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import Acceptance, SamplingConfig
from .tree import TreeBuffers


@dataclass
class Accepted:
    """The outcome of one verification step."""

    # [A] long: node indices of the accepted path, root first
    nodes: torch.Tensor
    # [] long: the token that follows the last accepted node (bonus, or recovered on rejection)
    bonus: torch.Tensor


ARGMAX_CHUNK = 1024  # vocabulary entries per chunk of first_argmax (the most; a power of two dividing V)


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] long: the first index of each row's maximum, as logits.argmax(-1).

    On CPU argmax runs a scalar loop, many times slower than amax: here the chunk holding the first
    maximum is found from the chunks' maxima, then the argmax is taken within it. Elsewhere, and where V has no power-of-two
    chunk of at least 64 entries, logits.argmax(-1)."""
    n, v = logits.shape
    chunk = min(v & -v, ARGMAX_CHUNK)
    if logits.device.type != "cpu" or chunk < 64:
        return logits.argmax(-1)
    chunks = logits.reshape(n, v // chunk, chunk)  # [N, C, chunk]
    top = chunks.amax(-1)  # [N, C]: NaN where a chunk holds one (argmax's answer then)
    if top.isnan().any():
        return logits.argmax(-1)
    first = (top == top.amax(-1, keepdim=True)).byte().argmax(-1)  # [N]: the first chunk holding the maximum
    return first * chunk + chunks[torch.arange(n, device=logits.device), first].argmax(-1)


def accept_greedy(tokens: torch.Tensor, logits: torch.Tensor, tree: TreeBuffers) -> Accepted:
    """Longest path whose every candidate equals the base model's argmax at its parent.

    tokens [N] long, logits [N, V]. Exact: the emitted tokens are those plain greedy decoding
    would emit. One device-to-host read (the accepted length).
    """
    pred = first_argmax(logits)  # [N]
    if tokens.numel() == 1:
        return Accepted(nodes=torch.zeros(1, dtype=torch.long, device=tokens.device), bonus=pred[0])
    # [N] bool: node agrees with the base model's choice at its parent (the root always does)
    ok = torch.ones_like(tokens, dtype=torch.bool)
    ok[1:] = tokens[1:] == pred[tree.parent[1:]]
    nodes = _longest_path(ok, tree)  # [A]
    return Accepted(nodes=nodes, bonus=pred[nodes[-1]])


def _longest_path(ok: torch.Tensor, tree: TreeBuffers) -> torch.Tensor:
    """ok [N] bool (root True) -> nodes [A] long: the longest root path of ok nodes, first on ties.

    One device-to-host read (the accepted length).
    """
    paths = tree.retrieve  # [P, L]
    on_path = ok[paths.clamp(min=0)] & (paths >= 0)  # [P, L]
    run = on_path.long().cumprod(-1).sum(-1)  # [P] accepted nodes on each path, root included
    # argmax returns the first maximum: ties go to the first path; one read for both numbers
    best, length = torch.stack([run.argmax(), run.max()]).tolist()
    return paths[best, :length]


@dataclass
class History:
    """What a row's penalties read: its output so far and its prompt's tokens."""

    counts: torch.Tensor  # [V] float32: how often each token was emitted (the root included)
    prompt: torch.Tensor  # [V] bool: tokens of the prompt (the repetition penalty reads them too)

    @classmethod
    def start(cls, prompt_ids: torch.Tensor, vocab: int) -> History:
        """prompt_ids [T] long -> an empty output history."""
        prompt = torch.zeros(vocab, dtype=torch.bool, device=prompt_ids.device)
        prompt[prompt_ids] = True
        return cls(torch.zeros(vocab, dtype=torch.float32, device=prompt_ids.device), prompt)

    def emit(self, tokens: torch.Tensor) -> None:
        """tokens [K] long, emitted."""
        self.counts.index_add_(0, tokens, torch.ones(tokens.shape, dtype=self.counts.dtype, device=tokens.device))


def penalize(logits: torch.Tensor, tokens: torch.Tensor, tree: TreeBuffers, history: History,
             sampling: SamplingConfig) -> torch.Tensor:
    """logits [N, V], tokens [N] long -> [N, V] float32: the logits after `sampling`'s penalties and
    bias, each node's with its own history: the row's output so far plus the candidates on its
    path from the root (itself included; the root was emitted already). Plain decoding is the
    one-node case, so a step's acceptance reads at every node the logits plain decoding would.

    In order (as vLLM): the repetition penalty (a logit of a token in the prompt or the history
    divided by it where positive, multiplied where negative), then frequency and presence
    penalties (minus f * count, minus p where count > 0), then logit_bias added."""
    n, vocab = logits.shape
    counts = history.counts.expand(n, vocab).clone()  # [N, V]
    if n > 1:  # + the path's candidates: node j (j >= 1) counts for node i when j is i or its ancestor
        i, j = tree.mask[:, 1:].to(logits.device).nonzero(as_tuple=True)  # [K] each
        counts.index_put_((i, tokens[j + 1]), torch.ones(i.shape, dtype=counts.dtype, device=logits.device),
                          accumulate=True)
    out = logits.float()
    seen = counts > 0  # [N, V]
    if sampling.repetition_penalty != 1:
        penalty = sampling.repetition_penalty
        out = torch.where(seen | history.prompt, torch.where(out > 0, out / penalty, out * penalty), out)
    if sampling.frequency_penalty:
        out = out - sampling.frequency_penalty * counts
    if sampling.presence_penalty:
        out = out - sampling.presence_penalty * seen.float()
    if sampling.logit_bias:
        ids = torch.tensor([t for t in sampling.logit_bias if 0 <= t < vocab], dtype=torch.long, device=out.device)
        bias = torch.tensor([sampling.logit_bias[t] for t in ids.tolist()], dtype=out.dtype, device=out.device)
        out[:, ids] += bias
    return out


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """logits [A, V] (the rows each token was drawn from), chosen [A] long -> per token its
    log-probability under the model's own distribution (log-softmax of the raw logits: no
    temperature, filter or penalty, as vLLM's default) and the `top` most likely (id, logprob)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [A, V]
    own = lp.gather(-1, chosen[:, None])[:, 0]  # [A]
    if top:
        top_lp, top_ids = lp.topk(top, dim=-1)  # [A, top] each
        values, ids = torch.cat([own[:, None], top_lp], -1).tolist(), top_ids.tolist()
    else:
        values, ids = own[:, None].tolist(), [[] for _ in range(own.shape[0])]
    return [(v[0], list(zip(i, v[1:]))) for v, i in zip(values, ids)]


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits [N, V] -> p [N, V] float32: the base model's sampling distribution at every node.

    In order: temperature (0 gives the one-hot argmax), top_k (0 keeps all), top_p (the
    smallest set of most likely tokens whose mass reaches top_p, never less than the top
    token), then renormalise. Each filter is applied to the output of the one before it.
    """
    if sampling.temperature == 0:
        # Filters cannot change a one-hot distribution; argmax ties resolve as accept_greedy's.
        p = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)  # [N, V]
        return p.scatter_(-1, first_argmax(logits)[:, None], 1.0)
    # shifted to max 0 first, the max kept at 0: a temperature too small for float32 then gives
    # the others -inf (probability 0), never inf - inf or 0 / 0
    shifted = logits.float() - logits.float().amax(-1, keepdim=True)  # [N, V], <= 0
    p = torch.softmax(torch.where(shifted == 0, 0.0, shifted / sampling.temperature), dim=-1)  # [N, V]
    vocab = p.shape[-1]
    top_k = sampling.top_k if 0 < sampling.top_k < vocab else 0
    if top_k == 0 and sampling.top_p >= 1:
        return p
    sorted_p, order = p.sort(dim=-1, descending=True)  # [N, V] each
    if top_k:
        sorted_p[:, top_k:] = 0
        sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    if sampling.top_p < 1:
        # Keep a token while the mass strictly before it is short of top_p: the first token
        # always stays, and the kept set is the smallest whose mass reaches top_p.
        before = sorted_p.cumsum(-1) - sorted_p  # [N, V]
        keep = before < sampling.top_p
        keep[:, 0] = True  # also when top_p is below float32's smallest number (it rounds to 0 there)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    return torch.zeros_like(p).scatter_(-1, order, sorted_p)  # [N, V]


def accept_rejection(
    tokens: torch.Tensor,
    p: torch.Tensor,
    tree: TreeBuffers,
    generator: torch.Generator | None = None,
) -> Accepted:
    """Lossless speculative sampling on a tree: tokens [N] long, p [N, V] -> Accepted.

    The candidates are deterministic (head top-k, n-gram copies), so each one is a one-hot
    draft q = onehot(x), as in EAGLE. At a node with target row p, the children x1, x2, ...
    are tried in rank order against a residual r, starting from r = p:
      accept x_k with probability min(1, r(x_k) / q(x_k)) = r(x_k), then descend to it;
      on rejection r <- normalise(max(0, r - onehot(x_k))), i.e. zero x_k and renormalise;
      if every child is rejected, draw the recovered token from r and stop.
    At a node with no children the bonus token is drawn from p at that node.

    Why it is exact: the child x_k is emitted with probability
      prod_{j<k} (1 - r_j(x_j)) * r_k(x_k) = (1 - sum_{j<k} p(x_j)) * p(x_k) / (1 - sum_{j<k} p(x_j))
      = p(x_k),
    and the recovered token y, not a candidate, with probability (1 - sum_j p(x_j)) * r(y) = p(y).
    So what each node emits is distributed exactly as p at that node, and an accepted child's
    row is p conditioned on the tokens so far; by induction over depth, the emitted sequence
    (accepted + recovered or bonus) is distributed as plain sampling from the base model.
    A candidate with p(x) = 0 is never accepted. Duplicate siblings are harmless: a token
    already rejected has r(x) = 0.

    Randomness: one uniform per non-root node and one multinomial draw, all from `generator`.
    Host syncs: one read of the per-node numbers; the walk itself is a Python loop over the
    at most ~64 nodes, on floats.
    """
    device = p.device
    n = tokens.numel()
    if n > 1:
        parent = tree.parent[1:].to(device)  # [N-1]
        p_cand = p[parent, tokens[1:]]  # [N-1] p at the parent of each candidate token
        row_mass = p.sum(-1)  # [N] 1 up to rounding; the renormalisations divide by it
        u = torch.rand(n - 1, generator=generator, device=device, dtype=torch.float64)  # [N-1]
        host = torch.cat([p_cand.double(), u, tokens[1:].double(), row_mass.double()]).tolist()
        p_cand_h, u_h = host[: n - 1], host[n - 1 : 2 * (n - 1)]
        tok_h, mass_h = host[2 * (n - 1) : 3 * (n - 1)], host[3 * (n - 1) :]
    path = [0]
    node = 0
    while True:
        rejected_tokens: set[float] = set()
        rejected_mass = 0.0  # p mass of the distinct tokens already rejected at this node
        for child in tree.children[node]:
            c = child - 1
            if tok_h[c] in rejected_tokens:
                continue  # already zeroed in r: r(x) = 0
            remaining = mass_h[node] - rejected_mass
            # r(x) = p(x) / (mass left); guard rounding that leaves the remainder <= 0
            accept_prob = min(1.0, p_cand_h[c] / remaining) if remaining > 0 else 0.0
            if u_h[c] < accept_prob:
                path.append(child)
                node = child
                break
            rejected_tokens.add(tok_h[c])
            rejected_mass += p_cand_h[c]
        else:
            break  # every child rejected, or a leaf: draw from the residual at `node`
    # At the last node every child was rejected (none at a leaf): r = p with them zeroed.
    kids = torch.tensor(tree.children[node], dtype=torch.long, device=device)  # [C]
    r = p[node].clone()  # [V]
    r[tokens[kids]] = 0
    total = r.sum()
    # All mass on rejected tokens only happens through rounding: then fall back to p.
    r = torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p[node])  # [V]
    bonus = torch.multinomial(r, 1, generator=generator)[0]  # []
    nodes = torch.tensor(path, dtype=torch.long, device=device)  # [A]
    return Accepted(nodes=nodes, bonus=bonus)


def accept_typical(
    tokens: torch.Tensor,
    p: torch.Tensor,
    tree: TreeBuffers,
    epsilon: float,
    alpha: float,
    generator: torch.Generator | None = None,
) -> Accepted:
    """Medusa's typical acceptance: tokens [N] long, p [N, V] -> Accepted. NOT lossless.

    A candidate x below node u is acceptable when p[u, x] > min(epsilon, alpha * exp(-H(p[u]))),
    H the entropy in nats (0 log 0 = 0): confident rows demand a likely token, flat rows
    accept less likely ones. The longest root path of acceptable nodes is kept (the first
    path on ties), and the bonus token is drawn from p at its last node.

    This changes the output distribution: it accepts any sufficiently typical candidate rather
    than reproducing p, trading fidelity for longer accepted runs. With a one-hot p
    (temperature 0) the threshold is min(epsilon, alpha) and only the argmax passes, so it
    reduces to accept_greedy as long as min(epsilon, alpha) < 1.
    """
    if tokens.numel() == 1:
        nodes = torch.zeros(1, dtype=torch.long, device=tokens.device)  # [A]
    else:
        entropy = -torch.special.xlogy(p, p).sum(-1)  # [N] nats, 0 log 0 = 0
        threshold = torch.clamp(alpha * torch.exp(-entropy), max=epsilon)  # [N]
        parent = tree.parent[1:].to(p.device)  # [N-1]
        ok = torch.ones_like(tokens, dtype=torch.bool)  # [N], the root always stands
        ok[1:] = p[parent, tokens[1:]] > threshold[parent]
        nodes = _longest_path(ok, tree)  # [A]
    bonus = torch.multinomial(p[nodes[-1]], 1, generator=generator)[0]  # []
    return Accepted(nodes=nodes, bonus=bonus)


def accept(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    tree: TreeBuffers,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
) -> Accepted:
    """Apply the rule `sampling.rule` to one verified tree: tokens [N] long, logits [N, V]."""
    rule = sampling.rule
    if rule is Acceptance.GREEDY:
        return accept_greedy(tokens, logits, tree)
    p = target_probs(logits, sampling)
    if rule is Acceptance.REJECTION:
        return accept_rejection(tokens, p, tree, generator)
    return accept_typical(tokens, p, tree, sampling.typical_epsilon, sampling.typical_alpha, generator)
