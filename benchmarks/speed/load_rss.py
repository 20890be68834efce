"""Peak RSS growth while a saved BertPkm folder loads through remote code, in a process without the package:

    python benchmarks/speed/load_rss.py FOLDER

A warm-up load on the meta device first (imports, remote code, no tensors); then the RSS is sampled every 2 ms during
`from_pretrained` and a read of every page of every tensor; prints the growth over the RSS before, and its ratio to the
bytes of the loaded tensors (tied ones once). A table held twice while loading would show as a ratio near 2.
"""
import json, os, sys, threading, time
sys.modules["modeling_pkm_bert"] = None
from transformers import AutoModelForMaskedLM

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

# warm-up: the same load on the meta device (imports, remote code, no tensors), so that only the tensors are measured;
# without Hub kernels, which are chosen per device (transformers >= 5.25 kernelizes by default and refuses "meta")
AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True, device_map="meta", use_kernels=False)
import gc; gc.collect()
before, peak, done = rss(), [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], rss()); time.sleep(0.002)
thread = threading.Thread(target=sample); thread.start()
model = AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True)
for t in model.state_dict().values():
    t.reshape(-1)[::512].float().sum()
done.append(1); thread.join()
peak = max(peak[0], rss())
nbytes = sum(t.nbytes for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
print(json.dumps({"folder": sys.argv[1], "growth_MB": round((peak - before) / 1e6, 1), "model_MB": round(nbytes / 1e6, 1),
                  "ratio": round((peak - before) / nbytes, 3)}))
