import sys, torch
sys.path.insert(0, "tests")
from test_hf import tiny_model
from pyexpcache.hf import GraphDecoder
variant = sys.argv[1]
model = tiny_model("qwen3_moe", device="cuda")
p = torch.tensor([[5]]).cuda()
d = GraphDecoder(model, 32)
e = GraphDecoder(model, 32, capture=False)
def prefill(dec):
    dec.kv.reset()
    out = model(input_ids=p, cache_position=torch.arange(1, device="cuda"), use_cache=True, past_key_values=dec.kv)
    dec.token.copy_(out.logits[:, -1].argmax(-1, keepdim=True)); dec.position.fill_(1)
with torch.no_grad():
    prefill(d); prefill(e)
    d._capture()
    if variant == "reprefill":
        prefill(d)
    if variant == "kvcompare":
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(d.kv.layers, e.kv.layers)):
            print("layer", i, "keys differ at", (a.keys != b.keys).nonzero()[:, 2].unique().tolist(), "ptr", a.keys.data_ptr())
    for i in range(4):
        d.graph.replay(); ld = d._logits.clone(); le = e._step().clone()
        print(variant, i, d.token.item(), e.token.item(), (ld.float() - le.float()).abs().max().item())
    if variant == "kvcompare":
        for i, (a, b) in enumerate(zip(d.kv.layers, e.kv.layers)):
            print("layer", i, "keys differ at", (a.keys != b.keys).nonzero()[:, 2].unique().tolist(), "ptr", a.keys.data_ptr())
