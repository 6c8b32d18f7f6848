//! Each form seen in real job files, as a small file in that form.

use super::*;

fn known(f: &JobFile, name: &str) -> Option<String> {
    match f.last(name)?.value.as_ref()? {
        Value::Known(v) => Some(v.clone()),
        Value::Unknown { .. } => None,
    }
}

fn unknown_why(f: &JobFile, name: &str) -> String {
    match f.last(name).and_then(|a| a.value.clone()) {
        Some(Value::Unknown { why, .. }) => why,
        other => panic!("{name}: expected unsettled, got {other:?} in {f:#?}"),
    }
}

fn form(f: &JobFile, name: &str) -> Form {
    f.last(name).unwrap_or_else(|| panic!("{name} not found in {f:#?}")).form
}

#[test]
fn shell_comments_several_assignments_and_unset() {
    let f = read(
        "#!/bin/bash\n\
         export NCCL_NET_GDR_LEVEL=LOC  # off\n\
         export NCCL_IB_HCA=mlx5_0 # first\n\
         export A=1 NCCL_DEBUG=INFO\n\
         export NCCL_SOCKET_IFNAME=eth0#x\n\
         export NCCL_IB_DISABLE=1\n\
         unset NCCL_IB_DISABLE\n\
         export NCCL_P2P_LEVEL='NVL # not a comment'\n",
    );
    assert_eq!(known(&f, "NCCL_NET_GDR_LEVEL").as_deref(), Some("LOC"));
    assert_eq!(known(&f, "NCCL_IB_HCA").as_deref(), Some("mlx5_0"));
    assert_eq!((known(&f, "A").as_deref(), known(&f, "NCCL_DEBUG").as_deref()), (Some("1"), Some("INFO")));
    assert_eq!(known(&f, "NCCL_SOCKET_IFNAME").as_deref(), Some("eth0#x"), "a # inside a word is text");
    assert_eq!(f.last("NCCL_IB_DISABLE").map(|a| (a.value.clone(), a.line, a.form)), Some((None, 7, Form::Unset)));
    assert_eq!(known(&f, "NCCL_P2P_LEVEL").as_deref(), Some("NVL # not a comment"));
    assert_eq!(f.last("NCCL_IB_HCA").map(|a| (a.line, a.form)), Some((3, Form::Export)));
}

#[test]
fn values_are_expanded_from_the_file_or_left_unsettled() {
    let f = read(
        "HCA=mlx5_2\n\
         export NCCL_IB_HCA=${NCCL_IB_HCA:-$LIST}\n\
         export NCCL_SOCKET_IFNAME=$(ip route | awk '{print $5}')\n\
         export NCCL_DEBUG=${LEVEL:-INFO}\n\
         export NCCL_IB_GID_INDEX=`cat /tmp/gid`\n\
         export NCCL_NET_GDR_LEVEL=\"$HCA\"\n\
         export NCCL_ALGO=${HCA:+Ring}\n\
         export NCCL_PROTO=$1\n",
    );
    assert!(unknown_why(&f, "NCCL_IB_HCA").contains("`$NCCL_IB_HCA` is not set in this file"), "{f:#?}");
    assert!(unknown_why(&f, "NCCL_SOCKET_IFNAME").contains("output of a command"));
    let why = unknown_why(&f, "NCCL_DEBUG");
    assert!(why.contains("$LEVEL") && why.contains("\"INFO\" where it does not"), "{why}");
    assert!(unknown_why(&f, "NCCL_IB_GID_INDEX").contains("cat /tmp/gid"));
    assert_eq!(known(&f, "NCCL_NET_GDR_LEVEL").as_deref(), Some("mlx5_2"));
    assert_eq!(known(&f, "NCCL_ALGO").as_deref(), Some("Ring"));
    assert!(unknown_why(&f, "NCCL_PROTO").contains("`$1`"));
    let f = read("export LIST=mlx5_0\nexport NCCL_IB_HCA=${NCCL_IB_HCA:-$LIST}\n");
    assert!(unknown_why(&f, "NCCL_IB_HCA").contains("\"mlx5_0\" where it does not"), "{f:#?}");
}

#[test]
fn command_prefixes_and_launcher_flags() {
    let f = read(
        "OMP_NUM_THREADS=4 NCCL_IB_DISABLE=1 python train.py\n\
         mpirun -np 16 -x NCCL_IB_HCA=mlx5_0,mlx5_1 -x LD_LIBRARY_PATH \\\n   -x \"NCCL_DEBUG=WARN\" ./a.out\n\
         mpiexec -genv NCCL_NET_GDR_LEVEL PHB -n 2 ./b\n\
         srun --export=ALL,NCCL_SOCKET_IFNAME=ib0,NCCL_ALGO=Tree python x.py\n\
         docker run --rm -e NCCL_P2P_DISABLE=1 --env=NCCL_PROTO=Simple --env NCCL_NET=Socket img\n\
         env -u NCCL_TOPO_FILE NCCL_MIN_NCHANNELS=8 python y.py\n\
         LOG=$(NCCL_CROSS_NIC=1 python z.py)\n\
         bash -c \"export NCCL_IB_GID_INDEX=3 && python w.py\"\n",
    );
    assert_eq!((known(&f, "NCCL_IB_DISABLE").as_deref(), form(&f, "NCCL_IB_DISABLE")), (Some("1"), Form::CommandPrefix));
    assert_eq!((known(&f, "NCCL_IB_HCA").as_deref(), form(&f, "NCCL_IB_HCA")), (Some("mlx5_0,mlx5_1"), Form::MpirunX));
    assert_eq!(f.last("NCCL_IB_HCA").map(|a| a.line), Some(2));
    assert_eq!((known(&f, "NCCL_DEBUG").as_deref(), f.last("NCCL_DEBUG").map(|a| a.line)), (Some("WARN"), Some(3)));
    assert_eq!((known(&f, "NCCL_NET_GDR_LEVEL").as_deref(), form(&f, "NCCL_NET_GDR_LEVEL")), (Some("PHB"), Form::MpirunGenv));
    assert_eq!((known(&f, "NCCL_SOCKET_IFNAME").as_deref(), form(&f, "NCCL_SOCKET_IFNAME")), (Some("ib0"), Form::SrunExport));
    assert_eq!(known(&f, "NCCL_ALGO").as_deref(), Some("Tree"));
    assert_eq!((known(&f, "NCCL_P2P_DISABLE").as_deref(), form(&f, "NCCL_P2P_DISABLE")), (Some("1"), Form::ContainerEnv));
    assert_eq!((known(&f, "NCCL_PROTO").as_deref(), known(&f, "NCCL_NET").as_deref()), (Some("Simple"), Some("Socket")));
    assert_eq!(f.last("NCCL_TOPO_FILE").map(|a| (a.value.clone(), a.form)), Some((None, Form::Unset)));
    assert_eq!((known(&f, "NCCL_MIN_NCHANNELS").as_deref(), form(&f, "NCCL_MIN_NCHANNELS")), (Some("8"), Form::Env));
    assert_eq!(known(&f, "NCCL_CROSS_NIC").as_deref(), Some("1"), "inside $( )");
    assert_eq!((known(&f, "NCCL_IB_GID_INDEX").as_deref(), form(&f, "NCCL_IB_GID_INDEX")), (Some("3"), Form::Export), "inside sh -c");
    assert_eq!(f.last("LD_LIBRARY_PATH"), None, "-x NAME passes a value the file does not set");
    assert!(f.last("LOG").is_some_and(|a| matches!(a.value, Some(Value::Unknown { .. }))));
}

#[test]
fn branches_and_functions_are_unsettled_and_heredocs_skipped() {
    let f = read(
        "export NCCL_DEBUG=INFO\n\
         if [ \"$ROCE\" = 1 ]; then\n  export NCCL_IB_GID_INDEX=3\n  export NCCL_DEBUG=INFO\nfi\n\
         setup() {\n  export NCCL_NET=Socket\n}\n\
         [ -n \"$X\" ] || export NCCL_IB_DISABLE=1\n\
         cat > cfg <<EOF\nexport NCCL_ALGO=Ring\nEOF\n\
         export NCCL_PROTO=Simple\n",
    );
    assert!(unknown_why(&f, "NCCL_IB_GID_INDEX").contains("inside an `if`"));
    assert_eq!(known(&f, "NCCL_DEBUG").as_deref(), Some("INFO"), "a branch that sets the value already set changes nothing");
    assert!(unknown_why(&f, "NCCL_NET").contains("inside a function"));
    assert!(unknown_why(&f, "NCCL_IB_DISABLE").contains("`||`"));
    assert_eq!(f.last("NCCL_ALGO"), None, "a here-document is text, not commands");
    assert_eq!((known(&f, "NCCL_PROTO").as_deref(), f.last("NCCL_PROTO").map(|a| a.line)), (Some("Simple"), Some(13)));
}

#[test]
fn a_script_plain_assignment_reaches_commands_only_when_exported() {
    let f = read("#!/bin/bash\nNCCL_IB_HCA=mlx5_0\nNCCL_DEBUG=INFO\nexport NCCL_DEBUG\npython train.py\n");
    let reach = |n: &str| f.job(n).unwrap().1;
    assert!(!reach("NCCL_IB_HCA") && reach("NCCL_DEBUG"));
    let env_file = read("NCCL_IB_HCA=mlx5_0\n");
    assert!(env_file.job("NCCL_IB_HCA").unwrap().1, "an env file is the environment");
    let all = read("#!/bin/sh\nset -a\nNCCL_IB_HCA=mlx5_0\n");
    assert!(all.job("NCCL_IB_HCA").unwrap().1);
}

#[test]
fn dockerfile_env_and_arg() {
    let f = read(
        "FROM nvcr.io/nvidia/pytorch:24.05-py3\n\
         ARG HCA=mlx5_4\n\
         ENV NCCL_IB_HCA=$HCA NCCL_DEBUG=INFO\n\
         ENV NCCL_SOCKET_IFNAME eth0\n\
         ENV NCCL_ALGO=\"Ring\" \\\n    NCCL_PROTO=Simple\n\
         # ENV NCCL_IB_DISABLE=1\n\
         RUN export NCCL_NET=IB && pip install x\n\
         ARG NCCL_P2P_LEVEL=NVL\n",
    );
    assert_eq!((known(&f, "NCCL_IB_HCA").as_deref(), form(&f, "NCCL_IB_HCA")), (Some("mlx5_4"), Form::DockerEnv));
    assert_eq!(known(&f, "NCCL_DEBUG").as_deref(), Some("INFO"));
    assert_eq!(known(&f, "NCCL_SOCKET_IFNAME").as_deref(), Some("eth0"));
    assert_eq!((known(&f, "NCCL_ALGO").as_deref(), known(&f, "NCCL_PROTO").as_deref()), (Some("Ring"), Some("Simple")));
    assert_eq!(f.last("NCCL_IB_DISABLE"), None);
    assert_eq!(known(&f, "NCCL_NET").as_deref(), Some("IB"));
    assert!(!f.job("NCCL_P2P_LEVEL").unwrap().1, "ARG is a build argument");
}

#[test]
fn compose_and_kubernetes_yaml() {
    let f = read(
        "services:\n  trainer:\n    image: x\n    environment:\n      - NCCL_IB_HCA=mlx5_0\n      - \"NCCL_DEBUG=${LEVEL:-WARN}\"\n\
         \x20 other:\n    environment:\n      NCCL_SOCKET_IFNAME: eth0   # bootstrap\n      NCCL_IB_GID_INDEX: \"3\"\n",
    );
    assert_eq!((known(&f, "NCCL_IB_HCA").as_deref(), form(&f, "NCCL_IB_HCA")), (Some("mlx5_0"), Form::YamlList));
    assert!(unknown_why(&f, "NCCL_DEBUG").contains("$LEVEL"));
    assert_eq!((known(&f, "NCCL_SOCKET_IFNAME").as_deref(), form(&f, "NCCL_SOCKET_IFNAME")), (Some("eth0"), Form::YamlMap));
    assert_eq!(known(&f, "NCCL_IB_GID_INDEX").as_deref(), Some("3"));
    let k = read(
        "apiVersion: v1\nkind: Pod\nspec:\n  containers:\n  - name: t\n    env:\n    - name: NCCL_IB_HCA\n      value: \"mlx5_1\"\n    - name: NCCL_DEBUG\n      valueFrom:\n        configMapKeyRef: {name: c, key: d}\n\
         \x20   - name: NCCL_TOPO_FILE\n      value: /etc/$(NCCL_IB_HCA).xml\n    command: [\"bash\", \"-c\", \"export NCCL_NET_GDR_LEVEL=PHB; torchrun x.py\"]\n\
         \x20   args:\n    - |\n      export NCCL_ALGO=Tree\n      mpirun -x NCCL_PROTO=LL ./a\n",
    );
    assert_eq!((known(&k, "NCCL_IB_HCA").as_deref(), form(&k, "NCCL_IB_HCA")), (Some("mlx5_1"), Form::KubernetesEnv));
    assert!(unknown_why(&k, "NCCL_DEBUG").contains("valueFrom"));
    assert_eq!(known(&k, "NCCL_TOPO_FILE").as_deref(), Some("/etc/mlx5_1.xml"));
    assert_eq!(known(&k, "NCCL_NET_GDR_LEVEL").as_deref(), Some("PHB"));
    assert_eq!((known(&k, "NCCL_ALGO").as_deref(), known(&k, "NCCL_PROTO").as_deref()), (Some("Tree"), Some("LL")));
    assert_eq!(k.last("NCCL_ALGO").map(|a| a.line), Some(17));
}

#[test]
fn python_and_toml() {
    let f = read(
        "import os\n\
         os.environ[\"NCCL_IB_HCA\"] = \"mlx5_0\"\n\
         os.environ['NCCL_DEBUG']='INFO'  # loud\n\
         os.environ[\"NCCL_SOCKET_IFNAME\"] = iface()\n\
         os.environ.setdefault(\"NCCL_IB_DISABLE\", \"0\")\n\
         runtime_env = {\"env_vars\": {\"NCCL_NET_GDR_LEVEL\": \"PHB\", 'NCCL_ALGO': 'Ring'}}\n\
         NCCL_PROTO = \"Simple\"\n",
    );
    assert_eq!((known(&f, "NCCL_IB_HCA").as_deref(), form(&f, "NCCL_IB_HCA")), (Some("mlx5_0"), Form::PythonEnviron));
    assert_eq!(known(&f, "NCCL_DEBUG").as_deref(), Some("INFO"));
    assert!(unknown_why(&f, "NCCL_SOCKET_IFNAME").contains("Python expression"));
    assert!(unknown_why(&f, "NCCL_IB_DISABLE").contains("setdefault"));
    assert_eq!((known(&f, "NCCL_NET_GDR_LEVEL").as_deref(), form(&f, "NCCL_NET_GDR_LEVEL")), (Some("PHB"), Form::DictEntry));
    assert_eq!(known(&f, "NCCL_ALGO").as_deref(), Some("Ring"));
    assert_eq!((known(&f, "NCCL_PROTO").as_deref(), form(&f, "NCCL_PROTO")), (Some("Simple"), Form::Spaced));
    let t = read("[env]\nNCCL_IB_HCA = \"=mlx5_3:1\"\nNCCL_DEBUG = 'WARN' # quiet\n");
    assert_eq!((known(&t, "NCCL_IB_HCA").as_deref(), known(&t, "NCCL_DEBUG").as_deref()), (Some("=mlx5_3:1"), Some("WARN")));
    let s = read("NCCL_IB_HCA = \"mlx5_0\"\nexport NCCL_DEBUG=INFO\n");
    assert_eq!((form(&s, "NCCL_IB_HCA"), known(&s, "NCCL_DEBUG").as_deref()), (Form::Spaced, Some("INFO")));
}

/// A Python launcher's `if` leaves what it sets to the running job; the
/// script's own `if __name__ == "__main__":` and a `def` do not.
#[test]
fn python_branches_are_unsettled() {
    let f = read(concat!(
        "import os\n",
        "os.environ[\"NCCL_DEBUG\"] = \"INFO\"\n",
        "if os.getenv(\"ROCE\"):\n",
        "    os.environ[\"NCCL_IB_DISABLE\"] = \"1\"\n",
        "def main():\n",
        "    os.environ[\"NCCL_IB_HCA\"] = \"mlx5_0\"\n",
        "    for i in range(2):\n",
        "        os.environ[\"NCCL_NET\"] = \"IB\"\n",
        "    os.environ[\"NCCL_ALGO\"] = \"Ring\"\n",
        "if __name__ == \"__main__\":\n",
        "    os.environ[\"NCCL_PROTO\"] = \"Simple\"\n",
        "    main()\n",
    ));
    assert!(unknown_why(&f, "NCCL_IB_DISABLE").contains("Python `if`"), "{f:#?}");
    assert!(unknown_why(&f, "NCCL_NET").contains("Python loop"));
    for (n, v) in [("NCCL_DEBUG", "INFO"), ("NCCL_IB_HCA", "mlx5_0"), ("NCCL_ALGO", "Ring"), ("NCCL_PROTO", "Simple")] {
        assert_eq!(known(&f, n).as_deref(), Some(v), "{n}");
    }
}

/// Arbitrary bytes never panic, and every line number is within the text.
#[test]
fn any_text_reads_without_panicking() {
    let alphabet: Vec<char> = "NCCL_IB=HCA$(){}[]'\"`\\ \n\t#;&|<>-:x,ENV- ".chars().collect();
    let mut rng = testkit::Rng(11);
    for _ in 0..3000 {
        let len = rng.index(80);
        let text: String = (0..len).map(|_| alphabet[rng.index(alphabet.len())]).collect();
        let f = read(&text);
        let lines = text.lines().count().max(1);
        for a in &f.assignments {
            assert!(a.line >= 1 && a.line <= lines + 1, "{text:?}: {a:?}");
        }
    }
}
