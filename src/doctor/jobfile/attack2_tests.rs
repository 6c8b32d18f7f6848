//! Second hostile review of the job-file reading: each test is one
//! attack, failing while the defect is there. The oracle is bash with a
//! fake launcher on PATH (scoping_tests).

use super::scoping_tests::{agrees, reading_sees, sh};
use super::*;

// ---- class 1: certain and possible launches ----

/// The certain launch saw the variable unexported; `export NAME` (same
/// assignment, only the mark changes) before a possible launch is not a
/// divergence for the reading (it compares assignment indexes), so the
/// possible launch's exported value is taken as the job's.
#[test]
fn export_mark_between_certain_and_possible_launch() {
    agrees(&sh("NCCL_IB_DISABLE=1\npython prep.py\nexport NCCL_IB_DISABLE\nif [ -n \"$X\" ]; then python train.py; fi\n"));
}

/// The same with `export -n` taking the mark away.
#[test]
fn unexport_between_certain_and_possible_launch() {
    agrees(&sh("export NCCL_IB_DISABLE=1\npython prep.py\nexport -n NCCL_IB_DISABLE\n[ -n \"$X\" ] && python train.py\n"));
}

// ---- class 1: builtins whose effect the reading does not model ----

/// `set +e` turns errexit off; the reading keeps it on, stops at
/// `false`, and neither reads nor sees what follows.
#[test]
fn set_plus_e_turns_errexit_off() {
    agrees(&sh("set -e\nset +e\nexport NCCL_IB_DISABLE=0\npython prep.py\nfalse\nexport NCCL_IB_DISABLE=1\npython train.py\n"));
}

/// `! false` never triggers errexit.
#[test]
fn negated_false_does_not_trigger_errexit() {
    agrees(&sh("set -e\nexport NCCL_IB_DISABLE=0\npython prep.py\n! false\nexport NCCL_IB_DISABLE=1\npython train.py\n"));
}

/// `let NAME++` assigns; the name is not assignment-shaped, and the file
/// assigns it elsewhere, so `seen` counts it as accounted.
#[test]
fn let_increment_assigns() {
    agrees(&sh("export NCCL_IB_DISABLE=0\nlet NCCL_IB_DISABLE++\npython x.py\n"));
}

/// `declare -i`: later assignments are arithmetic (`X` is X's value).
#[test]
fn integer_attribute_evaluates_assignments() {
    agrees(&sh("X=1\ndeclare -i NCCL_IB_DISABLE\nexport NCCL_IB_DISABLE=X\npython x.py\n"));
}

/// `export -p NAME` with a name exports it (bash ignores `-p` then).
#[test]
fn export_p_with_a_name_exports() {
    agrees(&sh("NCCL_IB_DISABLE=1\nexport -p NCCL_IB_DISABLE >/dev/null\npython x.py\n"));
}

/// `set +a` turns allexport off; the reading keeps it on.
#[test]
fn set_plus_a_turns_allexport_off() {
    agrees(&sh("set -a\nset +a\nNCCL_IB_DISABLE=1\npython x.py\n"));
}

/// `set +o allexport` is read as turning it on.
#[test]
fn set_plus_o_allexport_is_off() {
    agrees(&sh("set +o allexport\nNCCL_IB_DISABLE=1\npython x.py\n"));
}

// ---- class 1: env and exec options ----

/// `env -vi`: combined short options clear the environment.
#[test]
fn env_combined_short_options_clear() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nenv -vi PATH=\"$PATH\" GD_OUT=\"$GD_OUT\" python x.py\n"));
}

/// `env -uNAME`: the name attached to the option.
#[test]
fn env_u_attached_name() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nenv -uNCCL_IB_DISABLE python x.py\n"));
}

/// `env -S 'NAME=v python'`: env splits the string itself.
#[test]
fn env_split_string() {
    agrees(&sh("export NCCL_IB_DISABLE=1\npython prep.py\nenv -S 'NCCL_IB_DISABLE=0 python train.py'\n"));
}

/// `exec -c`: the command starts with an empty environment.
#[test]
fn exec_c_clears_the_environment() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nexec -c env PATH=\"$PATH\" GD_OUT=\"$GD_OUT\" python x.py\n"));
}

/// An alias that carries the assignment and the launcher.
#[test]
fn alias_with_assignment_and_launcher() {
    agrees(&sh("shopt -s expand_aliases\nexport NCCL_IB_DISABLE=1\nalias py='NCCL_IB_DISABLE=0 python'\npython prep.py\npy x.py\n"));
}

/// `sudo` without `-E` resets the environment, keeping what its sudoers
/// configuration keeps: a deciding variable may reach the job or not.
#[test]
fn sudo_keeps_the_environment_only_as_its_sudoers_says() {
    let f = read(&sh("export NCCL_IB_DISABLE=1\nsudo python x.py\n"));
    assert!(reading_sees(&f).is_err(), "{f:#?}");
    let f = read(&sh("export NCCL_IB_DISABLE=1\nsudo -E python x.py\n"));
    assert_eq!(reading_sees(&f), Ok(Some("1".into())));
}

/// `$'\e'` is an escape character, as bash reads it.
#[test]
fn ansi_c_quoting_reads_escapes() {
    let f = read(&sh("export NCCL_IB_DISABLE=$'\\x31\\e'\npython x.py\n"));
    assert_eq!(f.job("NCCL_IB_DISABLE").and_then(|(a, _)| a.value.clone()), Some(Value::Known("1\u{1b}".into())));
}
