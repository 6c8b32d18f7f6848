//! The property the doctor's job-file verdict rests on: random job files
//! (shell, Kubernetes YAML, Python, Dockerfile, with launcher fragments,
//! forms the reading knows and forms it does not) that mention a deciding
//! variable outside a comment are never judged "available" (exit 0)
//! unless the reading took that variable into an assignment with its
//! origin.

use super::capture::Capture;
use super::report::Options;

const SHELL: [&str; 14] = [
    "export NCCL_IB_DISABLE=1\n",
    "export NCCL_IB_DISABLE=0\n",
    "NCCL_IB_DISABLE=1 torchrun x.py\n",
    "mpirun -x NCCL_IB_DISABLE=1 python x.py\n",
    "mylauncher --env NCCL_IB_DISABLE=1 train\n",
    "cat > /etc/nccl.conf <<EOF\nNCCL_IB_DISABLE=1\nEOF\n",
    "echo NCCL_IB_DISABLE=1 >> ~/.nccl.conf\n",
    "eval \"export NCCL_IB_DISABLE=1\"\n",
    "if [ -n \"$X\" ]; then export NCCL_IB_DISABLE=1; fi\n",
    "python x.py\n",
    "# export NCCL_IB_DISABLE=1\n",
    "srun --export=ALL,NCCL_IB_DISABLE=1 python x.py\n",
    "X=\"NCCL_IB_DISABLE=1\"\n",
    "echo \"using NCCL_IB_DISABLE=$NCCL_IB_DISABLE\"\n",
];

const YAML: [&str; 7] = [
    "    - name: NCCL_IB_DISABLE\n      value: \"1\"\n",
    "    - name: NCCL_IB_DISABLE\n      valueFrom:\n        configMapKeyRef: {name: c, key: k}\n",
    "    command: [\"bash\", \"-c\", \"export NCCL_IB_DISABLE=1; torchrun x.py\"]\n",
    "    args: [\"--nccl\", \"NCCL_IB_DISABLE=1\"]\n",
    "    # NCCL_IB_DISABLE=1\n",
    "    - name: NCCL_DEBUG\n      value: INFO\n",
    "    resources: {limits: {note: \"NCCL_IB_DISABLE=1 here\"}}\n",
];

const PYTHON: [&str; 8] = [
    "os.environ[\"NCCL_IB_DISABLE\"] = \"1\"\n",
    "os.environ.update(NCCL_IB_DISABLE=\"1\")\n",
    "env = dict(os.environ, NCCL_IB_DISABLE=\"1\")\n",
    "subprocess.run(cmd, env={\"NCCL_IB_DISABLE\": \"1\"})\n",
    "if x:\n    os.environ[\"NCCL_IB_DISABLE\"] = \"1\"\n",
    "# os.environ[\"NCCL_IB_DISABLE\"] = \"1\"\n",
    "os.environ.setdefault(\"NCCL_IB_DISABLE\", \"1\")\n",
    "print(os.environ.get(\"NCCL_IB_DISABLE\"))\n",
];

const DOCKER: [&str; 7] = [
    "ENV NCCL_IB_DISABLE=1\n",
    "ENV NCCL_IB_DISABLE 1\n",
    "RUN echo NCCL_IB_DISABLE=1 >> /etc/nccl.conf\n",
    "ARG NCCL_IB_DISABLE=1\n",
    "CMD [\"torchrun\", \"x.py\"]\n",
    "LABEL note=\"NCCL_IB_DISABLE=1\"\n",
    "# ENV NCCL_IB_DISABLE=1\n",
];

/// Whether `fragment` mentions the variable outside a comment.
fn mentions(fragment: &str) -> bool {
    fragment.lines().any(|l| l.contains("NCCL_IB_DISABLE") && !l.trim_start().starts_with('#'))
}

#[test]
fn available_only_when_the_deciding_variable_was_read() {
    let capture = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json")).unwrap();
    let mut rng = testkit::Rng(4848);
    let (mut checked, mut available, mut open) = (0, 0, 0);
    for _ in 0..400 {
        let (head, pieces): (&str, &[&str]) = match rng.index(4) {
            0 => ("#!/bin/bash\n", &SHELL),
            1 => ("apiVersion: v1\nkind: Pod\nspec:\n  containers:\n  - name: t\n    env:\n", &YAML),
            2 => ("import os\nimport subprocess\n", &PYTHON),
            _ => ("FROM nvcr.io/nvidia/pytorch:24.05-py3\n", &DOCKER),
        };
        let chosen: Vec<&str> = (0..1 + rng.index(4)).map(|_| pieces[rng.index(pieces.len())]).collect();
        if !chosen.iter().any(|f| mentions(f)) {
            continue;
        }
        let text = format!("{head}{}", chosen.concat());
        let file = super::jobfile::read(&text);
        let mut c = Capture::parse(&capture, "dgx-pix").unwrap();
        c.env = super::jobenv::from_job_file(&file, "job");
        let r = super::sources::judge_capture(c, &Options::default()).unwrap();
        checked += 1;
        match r.exit_status() {
            0 => {
                available += 1;
                let read = file.assignments.iter().any(|a| a.name == "NCCL_IB_DISABLE") || file.printed.iter().any(|(n, _)| n == "NCCL_IB_DISABLE");
                assert!(read, "available, yet NCCL_IB_DISABLE was not read:\n{text}\n{}", r.verdict.line);
            }
            3 => open += 1,
            _ => {}
        }
    }
    assert!(checked > 200 && available > 0 && open > 0, "{checked} files, {available} available, {open} open");
}
