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
