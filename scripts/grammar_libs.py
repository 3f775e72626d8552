"""llguidance against xgrammar on the built-in model's tokenizer: schema compile time, mask time per
emitted token, the masks of a draft tree per step (llguidance: grammar.RowGrammar.walk, the
engine's walk; xgrammar: its native GrammarMatcher.traverse_draft_tree), and the tokens each one
alone allows along the answers. Input: plain constrained decoding's answers to the json suite's
24 prompts. Figures: docs/SERVING.md.

    .venv/bin/python scripts/grammar_libs.py answers answers.json
    python3 -m venv /tmp/xg && /tmp/xg/bin/pip install torch==2.13.0 && \\
        /tmp/xg/bin/pip install xgrammar llguidance transformers
    PYTHONPATH=src /tmp/xg/bin/python scripts/grammar_libs.py measure answers.json
"""

import json
import statistics
import sys
import time
from collections import Counter

VOCAB = 49152  # SmolLM2's
TREE_PARENTS = [-1, 0, 1, 2, 3, 0, 0, 1]  # the answer's next 4 tokens as a chain, 3 random candidates beside it
CHAIN = 5  # root + the chain: the nodes every library visits


def answers(out: str) -> None:
    from medusa_decoding import MedusaModel
    from medusa_decoding.bench.prompts import load_suite
    from medusa_decoding.models import model_folder
    from medusa_decoding.spec import DecodeSpec

    m = MedusaModel.from_pretrained("smollm2-135m-instruct", DecodeSpec.plain(), progress=False)
    rows = [{"schema": p.schema, "tokens": m.generate(p.turns[0], max_new_tokens=160, grammar=p.grammar).token_ids}
            for p in load_suite("json")]
    json.dump({"folder": str(model_folder("smollm2-135m-instruct")), "rows": rows}, open(out, "w"))


def allowed(bits, token: int) -> bool:
    return bool((int(bits[token >> 5]) >> (token & 31)) & 1)


def measure(path: str) -> None:
    import llguidance
    import llguidance.hf
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from medusa_decoding.grammar import JSON_LAYOUT, RowGrammar, fill_mask, new_bitmask
    from medusa_decoding.tree import tree_from_parents

    saved = json.load(open(path))  # the answers and the tokenizer's folder (the model's, in its cache)
    tok = AutoTokenizer.from_pretrained(saved["folder"])
    eos = [tok.eos_token_id]
    torch.set_num_threads(2)
    times = {lib: {"compile_ms": [], "mask_us": [], "tree_us": []} for lib in ("llguidance", "xgrammar")}

    def timed(lib: str, what: str, scale: float, fn):
        t = time.perf_counter()
        out = fn()
        times[lib][what].append((time.perf_counter() - t) * scale)
        return out

    t = time.perf_counter()
    llg_tok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=eos)
    wrap = {"llguidance": time.perf_counter() - t}
    t = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=eos),
                                   max_threads=2, cache_enabled=False)
    wrap["xgrammar"] = time.perf_counter() - t

    parent = torch.tensor(TREE_PARENTS)
    depth = torch.tensor([0, 1, 2, 3, 4, 1, 1, 2])
    tree = tree_from_parents(parent, depth, int(depth.max()))
    first_child, next_sibling = [-1] * len(parent), [-1] * len(parent)  # xgrammar's tree arrays
    for node, kids in enumerate(tree.children):
        if kids:
            first_child[node] = kids[0]
        for a, b in zip(kids, kids[1:]):
            next_sibling[a] = b
    first_child, next_sibling = torch.tensor(first_child), torch.tensor(next_sibling)
    gen = torch.Generator().manual_seed(0)
    only = {"llguidance": Counter(), "xgrammar": Counter()}  # tokens one library alone allows, along the chain

    for row in saved["rows"]:
        schema, toks = json.dumps(row["schema"]), [t for t in row["tokens"] if t not in eos]
        new_llg = lambda: llguidance.LLMatcher(  # noqa: E731
            llg_tok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT), log_level=0)
        llg = timed("llguidance", "compile_ms", 1e3, new_llg)
        compiled = timed("xgrammar", "compile_ms", 1e3, lambda: compiler.compile_json_schema(
            schema, any_whitespace=False, separators=(", ", ": ")))
        xg = xgr.GrammarMatcher(compiled)
        bits, xbits = new_bitmask(len(parent), VOCAB), xgr.allocate_token_bitmask(len(parent), VOCAB)
        for token in toks:  # one mask per emitted token
            timed("llguidance", "mask_us", 1e6, lambda: fill_mask(llg, bits, 0))
            timed("xgrammar", "mask_us", 1e6, lambda: xg.fill_next_token_bitmask(xbits, 0))
            assert llg.consume_token(token) and xg.accept_token(token)
        llg, xg = new_llg(), xgr.GrammarMatcher(compiled)
        rg = RowGrammar(llg, VOCAB)
        for i in range(0, len(toks) - CHAIN, 2):  # a tree every second answer token
            cand = torch.tensor(toks[i:i + CHAIN] + torch.randint(0, VOCAB, (len(parent) - CHAIN,), generator=gen).tolist())
            assert llg.consume_token(toks[i]) and xg.accept_token(toks[i])  # the root: emitted, consumed
            ours = timed("llguidance", "tree_us", 1e6, lambda: rg.masks(cand, tree))
            timed("xgrammar", "tree_us", 1e6, lambda: xg.traverse_draft_tree(first_child, next_sibling, cand, xbits))
            for node in range(CHAIN):
                differ = (ours[node] ^ xbits[node]).nonzero()[:, 0].tolist()
                for word in differ:
                    for j in range(word * 32, min(word * 32 + 32, VOCAB)):
                        a, b = allowed(ours[node], j), allowed(xbits[node], j)
                        if a != b:
                            only["llguidance" if a else "xgrammar"][tok.convert_ids_to_tokens(j)] += 1
            assert llg.consume_token(toks[i + 1]) and xg.accept_token(toks[i + 1])

    out = {"answers": len(saved["rows"]), "tokens": sum(len(r["tokens"]) for r in saved["rows"]),
           "tree_nodes": len(parent), "tokenizer_wrap_s": wrap}
    for lib, series in times.items():
        out[lib] = {k: {"median": statistics.median(v), "p90": sorted(v)[int(0.9 * len(v))], "n": len(v)}
                    for k, v in series.items()}
        out[lib]["tokens_only_it_allows"] = {"distinct": len(only[lib]), "most": only[lib].most_common(8)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    {"answers": answers, "measure": measure}[sys.argv[1]](sys.argv[2])
