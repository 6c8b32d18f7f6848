//! Hostile review of the job-file reading: each test is one attack.
//! The oracle is bash with a fake launcher on PATH (as in scoping_tests).

use super::scoping_tests::{agrees, bed, sh};
use super::*;

// ---- class 1: bash hands the launch a value the reading does not see ----

/// `A && B`: B runs only when A succeeds, like `||`'s other side.
#[test]
fn and_list_assignment_is_conditional() {
    agrees(&sh("export NCCL_IB_DISABLE=1\n[ -n \"$X\" ] && export NCCL_IB_DISABLE=0\npython x.py\n"));
}

/// `cmd || { echo; exit 1; }`: the `exit` runs only when cmd fails; the
/// reading stops at it and reads nothing after (nor does `seen`).
#[test]
fn exit_inside_or_group_does_not_stop_the_script() {
    agrees(&sh("export NCCL_IB_DISABLE=0\ncd / || { echo no; exit 1; }\nexport NCCL_IB_DISABLE=1\npython x.py\n"));
}

/// The same with `exec` in an `&&` group, not first in it.
#[test]
fn exec_inside_and_group_does_not_stop_the_script() {
    agrees(&sh("export NCCL_IB_DISABLE=0\n[ -n \"$X\" ] && { echo x; exec true; }\nexport NCCL_IB_DISABLE=1\npython x.py\n"));
}

/// `exec` first in an `&&` group (holds: the group's first command is
/// read as conditional).
#[test]
fn exec_first_in_and_group_holds() {
    agrees(&sh("export NCCL_IB_DISABLE=0\n[ -n \"$X\" ] && { exec true; }\nexport NCCL_IB_DISABLE=1\npython x.py\n"));
}

/// `exec {fd}>file` opens a descriptor; the script goes on.
#[test]
fn exec_named_descriptor_does_not_stop_the_script() {
    agrees(&sh("export NCCL_IB_DISABLE=0\nexec {LOG}>/dev/null\nexport NCCL_IB_DISABLE=1\npython x.py\n"));
}

/// A one-line `case` whose pattern's `)` closes every open block.
#[test]
fn one_line_case_pattern_is_conditional() {
    agrees(&sh("export NCCL_IB_DISABLE=1\ncase a in b) export NCCL_IB_DISABLE=0;; esac\npython x.py\n"));
}

/// The one-line `case` inside an `if` also ends the `if` for the reading.
#[test]
fn one_line_case_inside_if_ends_the_if() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nif [ -n \"$X\" ]; then\n  case a in a) true;; esac\n  export NCCL_IB_DISABLE=0\nfi\npython x.py\n"));
}

/// `function f() {` leaves a subshell open in the reading: a later
/// unconditional `exit` is no longer taken as one.
#[test]
fn function_keyword_with_parens_then_exit() {
    agrees(&sh("function f() { true; }\nexport NCCL_IB_DISABLE=1\npython x.py\nexit 0\nexport NCCL_IB_DISABLE=0\npython x.py\n"));
}

/// `f() ( ... )` leaves a function name pending: the next `{ }` group
/// is read as its body and undone.
#[test]
fn subshell_function_body_makes_next_group_a_function() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nf() ( true )\n{ export NCCL_IB_DISABLE=0; }\npython x.py\n"));
}

/// An array assignment `A=(x)` is read as a function name and a command.
#[test]
fn array_assignment_then_group() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nARGS=(--nproc 8)\n{ export NCCL_IB_DISABLE=0; }\npython x.py\n"));
}

/// An array's elements are read as a command that runs.
#[test]
fn array_elements_are_not_a_command() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nWORDS=(export NCCL_IB_DISABLE=0)\npython x.py\n"));
}

/// `mpirun "${OPTS[@]}"`: the array's `-x NAME=v` reaches the ranks.
#[test]
fn mpirun_flags_from_an_array() {
    agrees(&sh("OPTS=(-x NCCL_IB_DISABLE=1)\nmpirun \"${OPTS[@]}\" python x.py\n"));
}

/// `printf -v NAME` assigns NAME in the shell.
#[test]
fn printf_v_assigns() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nprintf -v NCCL_IB_DISABLE %s 0\npython x.py\n"));
}

/// `read NAME` assigns NAME.
#[test]
fn read_assigns() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nread NCCL_IB_DISABLE <<< 0\npython x.py\n"));
}

/// A `for` loop's variable keeps its last value.
#[test]
fn for_loop_variable_assigns() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nfor NCCL_IB_DISABLE in 0; do :; done\npython x.py\n"));
}

/// `(( NAME = v ))` is arithmetic in this shell, not a subshell.
#[test]
fn arithmetic_command_assigns() {
    agrees(&sh("export NCCL_IB_DISABLE=1\n((NCCL_IB_DISABLE=0))\npython x.py\n"));
}

/// `NAME+=v` appends.
#[test]
fn append_assignment() {
    agrees(&sh("export NCCL_IB_DISABLE=\nNCCL_IB_DISABLE+=1\npython x.py\n"));
}

/// A nameref assigns through to the name it refers to.
#[test]
fn nameref_assigns_through() {
    agrees(&sh("export NCCL_IB_DISABLE=1\ndeclare -n R=NCCL_IB_DISABLE\nR=0\npython x.py\n"));
}

/// `export $V=v` with V naming the variable.
#[test]
fn export_through_a_variable_name() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nV=NCCL_IB_DISABLE\nexport $V=0\npython x.py\n"));
}

/// Brace expansion makes an assignment out of a word that is not one.
#[test]
fn export_with_brace_expansion() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nexport NCCL_IB_DISABLE{,}=0\npython x.py\n"));
}

/// With `lastpipe` the pipeline's last element runs in this shell.
#[test]
fn lastpipe_keeps_the_last_element() {
    agrees(&sh("shopt -s lastpipe\nexport NCCL_IB_DISABLE=1\ntrue | export NCCL_IB_DISABLE=0\npython x.py\n"));
}

/// In POSIX mode a special builtin's prefix assignment stays.
#[test]
fn posix_mode_special_builtin_prefix_persists() {
    agrees(&sh("set -o posix\nexport NCCL_IB_DISABLE=1\nNCCL_IB_DISABLE=0 :\npython x.py\n"));
}

/// `local` outside a function is an error: nothing is assigned.
#[test]
fn local_outside_a_function_assigns_nothing() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nlocal NCCL_IB_DISABLE=0\npython x.py\n"));
}

/// A launcher named through a variable is the last launch.
#[test]
fn launcher_through_a_variable() {
    agrees(&sh("export NCCL_IB_DISABLE=0\npython prep.py\nexport NCCL_IB_DISABLE=1\nPY=python\n$PY train.py\n"));
}

/// `${PYTHON:-python}` as the launcher.
#[test]
fn launcher_through_a_default() {
    agrees(&sh("export NCCL_IB_DISABLE=0\npython prep.py\nexport NCCL_IB_DISABLE=1\n${PYTHON:-python} train.py\n"));
}

/// A profiler in front of the launcher (`nsys profile python`).
#[test]
fn launcher_behind_a_profiler() {
    agrees(&sh("export NCCL_IB_DISABLE=0\npython prep.py\nexport NCCL_IB_DISABLE=1\nnsys profile python train.py\n"));
}

/// A script printed into a shell: `echo '...' | bash`.
#[test]
fn echo_piped_into_bash() {
    agrees(&sh("export NCCL_IB_DISABLE=1\necho 'export NCCL_IB_DISABLE=0; python x.py' | bash\n"));
}

/// `eval $(echo NAME=v)`: echo's text, run by eval.
#[test]
fn eval_of_echo_output() {
    agrees(&sh("export NCCL_IB_DISABLE=1\neval $(echo NCCL_IB_DISABLE=0)\npython x.py\n"));
}

/// `source <(echo ...)`.
#[test]
fn source_of_process_substitution() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nsource <(echo export NCCL_IB_DISABLE=0)\npython x.py\n"));
}

/// A process substitution is a subshell, not the script's own level.
#[test]
fn process_substitution_is_a_subshell() {
    agrees(&sh("export NCCL_IB_DISABLE=1\ncat <(export NCCL_IB_DISABLE=0) >/dev/null\npython x.py\n"));
}

/// A `(` in a comment inside `$( )`: bash ends the substitution at the
/// next `)`, the reading at a later one, swallowing the launch.
#[test]
fn comment_with_paren_inside_command_substitution() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nX=$( # (\n)\nexport NCCL_IB_DISABLE=0\npython x.py\n# )\n"));
}

/// A `case` inside `$( )`: its pattern's `)` ends the substitution for
/// the reading, so what follows runs at the script's level.
#[test]
fn case_inside_command_substitution() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nX=$(case a in a) export NCCL_IB_DISABLE=0;; esac)\npython x.py\n"));
}

/// A `)` in a here-document inside `$( )`.
#[test]
fn paren_in_heredoc_inside_command_substitution() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nX=$(cat <<EOF\n)\nexport NCCL_IB_DISABLE=0\nEOF\n)\npython x.py\n"));
}

/// `env -i` starts the command with an empty environment.
#[test]
fn env_i_clears_the_environment() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nenv -i PATH=\"$PATH\" GD_OUT=\"$GD_OUT\" python x.py\n"));
}

/// `env --unset=NAME`.
#[test]
fn env_unset_long_form() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nenv --unset=NCCL_IB_DISABLE python x.py\n"));
}

/// `env -u` behind a wrapper (`nohup env -u NAME python`).
#[test]
fn env_unset_behind_a_wrapper() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nnohup env -u NCCL_IB_DISABLE python x.py\n"));
}

/// `set -e` and a failing command: nothing after it runs.
#[test]
fn errexit_stops_at_a_failing_command() {
    agrees(&sh("set -e\nexport NCCL_IB_DISABLE=0\npython prep.py\nfalse\nexport NCCL_IB_DISABLE=1\npython train.py\n"));
}

/// The last launch inside an `if` that does not run.
#[test]
fn last_launch_inside_an_if_that_does_not_run() {
    agrees(&sh("export NCCL_IB_DISABLE=1\npython prep.py\nexport NCCL_IB_DISABLE=0\nif [ -n \"$X\" ]; then python train.py; fi\n"));
}

/// A read-only variable given as a launch's prefix.
#[test]
fn readonly_prefix_on_the_launch() {
    agrees(&sh("readonly NCCL_IB_DISABLE=1\nexport NCCL_IB_DISABLE\nNCCL_IB_DISABLE=0 python x.py\n"));
}

/// `eval` of a quoted assignment (holds: `seen` lists it).
#[test]
fn eval_of_a_quoted_assignment_holds() {
    agrees(&sh("export NCCL_IB_DISABLE=1\neval 'export NCCL_IB_DISABLE=0'\npython x.py\n"));
}

/// `command export` (holds: `seen` lists it).
#[test]
fn command_export_holds() {
    agrees(&sh("export NCCL_IB_DISABLE=1\ncommand export NCCL_IB_DISABLE=0\npython x.py\n"));
}

/// `cat <<EOF | bash` (holds).
#[test]
fn heredoc_piped_into_bash_holds() {
    agrees(&sh("export NCCL_IB_DISABLE=1\ncat <<EOF | bash\nexport NCCL_IB_DISABLE=0\npython x.py\nEOF\n"));
}

/// `bash <<< '...'` (holds: `seen` lists it).
#[test]
fn herestring_into_bash_holds() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nbash <<< 'export NCCL_IB_DISABLE=0; python x.py'\n"));
}

/// `set -k` (holds: `seen` lists it).
#[test]
fn keyword_mode_holds() {
    agrees(&sh("set -k\nexport NCCL_IB_DISABLE=1\npython x.py NCCL_IB_DISABLE=0\n"));
}

/// A function called through a variable.
#[test]
fn function_called_through_a_variable() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nf() { export NCCL_IB_DISABLE=0; }\nF=f\n$F\npython x.py\n"));
}

/// A multi-line double-quoted string whose second line starts with `#`:
/// `seen` takes that line for a comment, bash runs the rest of it.
#[test]
fn multiline_string_hides_eval_from_seen() {
    agrees(&sh("export NCCL_IB_DISABLE=1\nX=\"\n#\"; eval \"export NCCL_IB_DISABLE=0\"\npython x.py\n"));
}

/// The name split by a backslash: `seen` finds `NCCL_IB_`, not the
/// deciding name; eval joins it.
#[test]
fn name_split_by_backslash_in_eval() {
    agrees(&sh("export NCCL_IB_DISABLE=1\neval export NCCL_IB_\\DISABLE=0\npython x.py\n"));
}

/// A sourced file the reading does not follow: bash runs what it sets.
#[test]
fn sourced_file_is_not_read() {
    std::fs::write(bed().join("gd-env.sh"), "export NCCL_IB_DISABLE=0\n").unwrap();
    agrees(&sh("export NCCL_IB_DISABLE=1\nsource ./gd-env.sh\npython x.py\n"));
}

/// A deciding name written to NCCL's configuration file by `echo`: it
/// is neither read nor listed as seen (echo's text counts as accounted).
#[test]
fn echo_into_nccl_conf_is_seen() {
    for text in [
        "#!/bin/bash\necho 'NCCL_NET=Socket' >> ~/.nccl.conf\npython x.py\n",
        "#!/bin/bash\nprintf 'NCCL_IB_DISABLE=1\\n' | tee /etc/nccl.conf\npython x.py\n",
    ] {
        let f = read(text);
        let name = if text.contains("NCCL_NET") { "NCCL_NET" } else { "NCCL_IB_DISABLE" };
        let read_it = f.job(name).is_some();
        let seen = f.seen.iter().any(|s| s.name == name);
        assert!(read_it || seen, "{name} reaches NCCL through its configuration file, yet is neither read nor seen:\n{text}");
    }
}

/// The echo exemption alone: `echo NAME=v > file; source file`.
#[test]
fn echo_into_a_file_then_sourced() {
    agrees(&sh("export NCCL_IB_DISABLE=1\necho 'export NCCL_IB_DISABLE=0' > gd-gen.sh\n. ./gd-gen.sh\npython x.py\n"));
}

// ---- class 8: work and memory that grow faster than the file ----

/// A function setting K names called M times records K x M assignments
/// (each with its own `why` text): 200 000 from a 7 KB file.
#[test]
fn cost_function_calls_record_k_times_m_assignments() {
    let body: String = (0..100).map(|i| format!("export NCCL_F{i:03}=1;")).collect();
    let text = format!("#!/bin/bash\nf() {{ {body} }}\n{}python x.py\n", "f\n".repeat(2000));
    let f = read(&text);
    assert!(f.assignments.len() <= 4 * text.len(), "{} assignments from {} bytes", f.assignments.len(), text.len());
}

/// `bash -c "$S"` reads S again at each call: 50 000 assignments from a
/// 9 KB file.
#[test]
fn cost_bash_c_reads_the_variable_again_each_call() {
    let text = format!("#!/bin/bash\nS='{}'\n{}python x.py\n", "export NCCL_X=1;".repeat(100), "bash -c \"$S\"\n".repeat(500));
    let f = read(&text);
    assert!(f.assignments.len() <= 4 * text.len(), "{} assignments from {} bytes", f.assignments.len(), text.len());
}
