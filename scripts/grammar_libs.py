"""llguidance against xgrammar on the built-in model's tokenizer: schema compile time, mask time per
emitted token, and the masks of a draft tree per step (llguidance: grammar.RowGrammar.walk, the
engine's walk; xgrammar: its native GrammarMatcher.traverse_draft_tree), on the answers plain
constrained decoding gives to the json suite's 24 prompts. Figures: docs/SERVING.md.

    .venv/bin/python scripts/grammar_libs.py answers answers.json     # plain constrained answers
    python3 -m venv /tmp/xg && /tmp/xg/bin/pip install torch==2.13.0 && \
        /tmp/xg/bin/pip install xgrammar llguidance transformers
    PYTHONPATH=src /tmp/xg/bin/python scripts/grammar_libs.py measure answers.json
"""

import json
import statistics
import sys
import time


def answers(out: str) -> None:
    from medusa_decoding import MedusaModel
    from medusa_decoding.bench.prompts import load_suite
    from medusa_decoding.models import model_folder
    from medusa_decoding.spec import DecodeSpec

    m = MedusaModel.from_pretrained("smollm2-135m-instruct", DecodeSpec.plain(), progress=False)
    rows = []
    for p in load_suite("json"):
        o = m.generate(p.turns[0], max_new_tokens=160, grammar=p.grammar)
        rows.append({"schema": p.schema, "tokens": o.token_ids})
    json.dump({"folder": str(model_folder("smollm2-135m-instruct")), "rows": rows}, open(out, "w"))


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
    V, EOS = 49152, [tok.eos_token_id]
    rows = saved["rows"]
    torch.set_num_threads(2)

    t = time.perf_counter(); llg_tok = llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=EOS); llg_wrap = time.perf_counter() - t
    t = time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=EOS); compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False); xg_wrap = time.perf_counter() - t

    # the tree of every step: the answer's next 4 tokens as a chain (each valid: every node visited),
    # two more candidates under the root and one under the first chain node (random: mostly forbidden)
    parent = torch.tensor([-1, 0, 1, 2, 3, 0, 0, 1]); depth = torch.tensor([0, 1, 2, 3, 4, 1, 1, 2])
    tree = tree_from_parents(parent, depth, 4, 0)
    N = parent.numel()
    nxt, sib = [-1] * N, [-1] * N  # xgrammar's first-child / next-sibling arrays
    for node in range(N):
        kids = tree.children[node]
        if kids:
            nxt[node] = kids[0]
            for a, b in zip(kids, kids[1:]):
                sib[a] = b
    nxt, sib = torch.tensor(nxt), torch.tensor(sib)
    gen = torch.Generator().manual_seed(0)
    diff, diffs = [], []

    res = {"llguidance": {"compile_ms": [], "mask_us": [], "tree_us": []}, "xgrammar": {"compile_ms": [], "mask_us": [], "tree_us": []}}
    for row in rows:
        schema, toks = json.dumps(row["schema"]), row["tokens"]
        if toks and toks[-1] in EOS: toks = toks[:-1]
        # compile
        t = time.perf_counter()
        m = llguidance.LLMatcher(llg_tok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT), log_level=0)
        res["llguidance"]["compile_ms"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        cg = compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
        x = xgr.GrammarMatcher(cg)
        res["xgrammar"]["compile_ms"].append((time.perf_counter() - t) * 1e3)
        # the masks along the answer, one token at a time
        bits = new_bitmask(N, V)
        xb = xgr.allocate_token_bitmask(N, V)
        for lib in ("llguidance", "xgrammar"):
            for tk in toks:
                t = time.perf_counter()
                if lib == "llguidance": fill_mask(m, bits, 0)
                else: x.fill_next_token_bitmask(xb, 0)
                res[lib]["mask_us"].append((time.perf_counter() - t) * 1e6)
                ok = m.consume_token(tk) if lib == "llguidance" else x.accept_token(tk)
                assert ok, (lib, tk)
        # tree masks, each step at every second answer token
        m = llguidance.LLMatcher(llg_tok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT), log_level=0)
        x = xgr.GrammarMatcher(cg)
        rg = RowGrammar(m, V)
        for i in range(0, len(toks) - 5, 2):
            cand = torch.tensor([toks[i]] + toks[i + 1:i + 5] + torch.randint(0, V, (3,), generator=gen).tolist())
            m.consume_token(toks[i]); x.accept_token(toks[i])  # the root: emitted, consumed
            t = time.perf_counter(); a = rg.masks(cand, tree); res["llguidance"]["tree_us"].append((time.perf_counter() - t) * 1e6)
            t = time.perf_counter(); x.traverse_draft_tree(nxt, sib, cand, xb); res["xgrammar"]["tree_us"].append((time.perf_counter() - t) * 1e6)
            # same allowed sets on the chain nodes (the libraries may differ on the forbidden ones)
            diff.append(int((a[:5] ^ xb[:5]).to(torch.int64).view(-1).ne(0).sum()))
            if diff[-1] and len(diffs) < 5: diffs.append([tok.convert_ids_to_tokens(j) for j in range(V) if ((int(a[1, j >> 5]) >> (j & 31)) & 1) != ((int(xb[1, j >> 5]) >> (j & 31)) & 1)][:8])
            m.consume_token(toks[i + 1]); x.accept_token(toks[i + 1])
    out = {"tokenizer_wrap_s": {"llguidance": llg_wrap, "xgrammar": xg_wrap}, "answers": len(rows), "tokens": sum(len(r["tokens"]) for r in rows),
           "tree_nodes": N}
    for lib, r in res.items():
        out[lib] = {k: {"median": statistics.median(v), "p90": sorted(v)[int(0.9 * len(v))], "n": len(v)} for k, v in r.items()}
    out["differing_mask_words"] = sum(diff); out["steps"] = len(diff); out["examples"] = diffs
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    {"answers": answers, "measure": measure}[sys.argv[1]](sys.argv[2])
