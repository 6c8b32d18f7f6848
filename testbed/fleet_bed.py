"""The fleet gate's bed test, the parts in Python (testbed/fleet-bed).

prepare DIR FIXTURE: 64 nodes' captures (node001..node064) from a fixture
capture, a few broken as the field breaks them, written to DIR.
verify REPORT [--intruder NAME]: the `fleet check --json` report names
exactly the broken nodes, each with its cause, and nothing else.
"""

import copy
import json
import sys

NODES = 64
# Would stage: a rank environment with NCCL_IB_DISABLE=1; two nodes with
# neither dma-buf nor peer memory.
STAGING = {"node007": "ib_disable", "node023": "no_path", "node041": "no_path"}
# Verdict holds, set apart from the rest: NCCL_IB_HCA leaving out the
# nearest NIC; an older driver.
DIFFERENT = {"node050": "far_hca", "node061": "old_driver"}


def set_env(c, k, v):
    c["env"]["vars"].append([k, v])
    c["env"]["origins"].append([k, "rank environment"])


def mutate(c, how):
    if how == "ib_disable":
        set_env(c, "NCCL_IB_DISABLE", "1")
    elif how == "far_hca":
        set_env(c, "NCCL_IB_HCA", "=mlx5_1")
    elif how == "no_path":
        for g in c["gpus"]["Ok"]:
            g["dma_buf_supported"] = False
        for r in c["rdma"]["Ok"]:
            r["dma_buf"] = {"Ok": {"Unsupported": 95}}
    elif how == "old_driver":
        for g in c["gpus"]["Ok"]:
            g["driver_version"] = 12020
    else:
        raise ValueError(how)


def prepare(out, fixture):
    base = json.load(open(fixture))
    for i in range(1, NODES + 1):
        name = "node%03d" % i
        c = copy.deepcopy(base)
        how = STAGING.get(name) or DIFFERENT.get(name)
        if how:
            mutate(c, how)
        with open("%s/%s.json" % (out, name), "w") as f:
            json.dump(c, f)


def verify(path, intruder):
    r = json.load(open(path))
    problems = []

    def expect(what, got, want):
        if got != want:
            problems.append("%s: got %r, want %r" % (what, got, want))

    expect("nodes judged", r["nodes"], NODES)
    expect("missing", r["missing"], 0)
    expect("unexpected", r.get("unexpected"), [])
    groups = sorted(sorted(g["names"]) for g in r["staging"])
    expect("staging groups", groups, [["node007"], ["node023", "node041"]])
    for g in r["staging"]:
        if g["names"] == ["node007"]:
            expect("node007's cause", g["checks"], ["env.nccl_ib_disable"])
    named = sorted({n for d in r["differences"] for o in d["others"] for n in o["names"]})
    expect("nodes set apart where the verdict holds", named, sorted(DIFFERENT))
    unreadable = [(u["file"], u["error"]) for u in r["unreadable"]]
    if intruder:
        ok = len(unreadable) == 1 and ("/%s " % intruder) in unreadable[0][0] and "did not verify" in unreadable[0][1]
        if not ok:
            problems.append("the intruder's posting should be the one unreadable, refused for its seal: %r" % unreadable)
    else:
        expect("unreadable", unreadable, [])
    expect("available everywhere", r["available_everywhere"], False)
    if problems:
        print("fleet-bed: %s:\n  %s" % (path, "\n  ".join(problems)))
        return 1
    print("fleet-bed: %s: %d nodes, staging %s, set apart %s%s" % (path, r["nodes"], groups, named, ", the intruder refused" if intruder else ""))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "verify":
        intruder = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--intruder" else None
        sys.exit(verify(sys.argv[2], intruder))
    else:
        sys.exit("usage: fleet_bed.py prepare DIR FIXTURE | verify REPORT [--intruder NAME]")
