"""PyTorch's side of bench/curve.sh: GPT-2 (bench/gpu_torch.py's) trained from
the weights and batches bench/curve.lua's prepare wrote to DIR, with the lrs
dslua's run took (its OUT.json), printing each step's loss:
    python3 bench/curve_torch.py DIR DSLUA.json OUT.json
Reads the safetensors files with plain Python and torch (json, frombuffer).
Fused AdamW, bf16 through autocast over fp32 weights (run.json's dtype),
gradient clipping; the vocab padded to 50304, the loss over GPT-2's 50257."""
import json
import sys

import torch

from gpu_torch import GPT

DTYPES = {"F32": torch.float32, "I64": torch.int64}
# save_hf's GPT-2 names (nanoGPT's) -> gpu_torch.GPT's; Hugging Face's Conv1D
# weights, [in, out], are transposed back
RENAME = ((".attn.c_attn.", ".c_attn."), (".attn.c_proj.", ".c_proj."), (".mlp.c_fc.", ".c_fc."),
          (".mlp.c_proj.", ".mlp_proj."))
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def read_safetensors(path):
    """{name: tensor} of a safetensors file: a u64 header length, the JSON
    header (dtype, shape, data_offsets from the data's start), the data."""
    with open(path, "rb") as f:
        buf = bytearray(f.read())
    n = int.from_bytes(buf[:8], "little")
    out = {}
    for name, e in json.loads(buf[8 : 8 + n]).items():
        if name == "__metadata__":
            continue
        if e["dtype"] not in DTYPES:
            sys.exit(f"bench/curve_torch.py: {path}: tensor {name} is {e['dtype']}, not one of {list(DTYPES)}")
        a, b = e["data_offsets"]
        dt = DTYPES[e["dtype"]]
        count = (b - a) // dt.itemsize
        out[name] = torch.frombuffer(buf, dtype=dt, count=count, offset=8 + n + a).reshape(e["shape"])
    return out


def state_dict(raw, V):
    sd = {}
    for name, t in raw.items():
        if name.endswith(CONV1D):
            t = t.t()
        name = name.removeprefix("transformer.")
        for a, b in RENAME:
            name = name.replace(a, b)
        sd[name] = t
    wte = torch.zeros(V, sd["wte.weight"].shape[1])   # the padded rows start at zero, as dslua's
    wte[: sd["wte.weight"].shape[0]] = sd["wte.weight"]
    sd["wte.weight"] = sd["lm_head.weight"] = wte
    return sd


def main(folder, lrs_path, out_path):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with open(folder + "/run.json") as f:
        run = json.load(f)
    with open(lrs_path) as f:
        lrs = json.load(f)["lrs"]
    tokens = read_safetensors(folder + "/batches.safetensors")["tokens"].to(dev)
    steps, T, V = run["steps"], run["block"], 50304
    if len(lrs) != steps:
        sys.exit(f"bench/curve_torch.py: {lrs_path} holds {len(lrs)} lrs for {steps} steps")
    with torch.device(dev):
        model = GPT(V=V, T=T, L=run["n_layer"], H=run["n_head"], C=run["n_embd"], classes=50257)
    model.load_state_dict(state_dict(read_safetensors(folder + "/weights/model.safetensors"), V))
    opt = torch.optim.AdamW(model.parameters(), lr=lrs[0], betas=tuple(run["betas"]), eps=run["eps"],
                            weight_decay=run["weight_decay"], fused=dev == "cuda")
    losses = []
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = lrs[s]
        w = tokens[s]
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=run["dtype"] == "bf16"):
            loss = model(w[:, :-1], w[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"step {s + 1:3d}  lr {lrs[s]:.4e}  loss {losses[-1]:.6f}", flush=True)
    with open(out_path, "w") as f:
        json.dump({"losses": losses, "lrs": lrs}, f)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python3 bench/curve_torch.py DIR DSLUA.json OUT.json")
    main(*sys.argv[1:])
