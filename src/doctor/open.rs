//! What a verdict of "available" would rest on that was not read or
//! seen: the doctor says "available" only when this list is empty; else
//! the verdict is open ("cannot tell", exit 3) and names each. A leaf:
//! plain data, nothing above it.

use serde::Serialize;

/// One thing the verdict would rest on that was not read or seen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Unseen {
    /// A deciding variable the job file leaves to the running job, or
    /// names in a form the reading does not take into a value.
    Variable {
        /// The variable.
        name: String,
        /// Where (`job.sh line 4 (export)`).
        origin: String,
        /// Its text as written.
        text: String,
        /// Why the file does not settle it.
        why: String,
        /// The values it may have, where the file lists them (branches
        /// that set known values; `None`: unset); empty when they cannot
        /// be listed.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        alternatives: Vec<Option<String>>,
    },
    /// A fact of the machine the rules need for the pair, not recorded
    /// or not readable (a capture without sysfs, an old capture that did
    /// not look for a network plugin).
    Fact {
        /// What is missing, and what would show it.
        what: String,
    },
}

impl std::fmt::Display for Unseen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unseen::Variable { name, origin, text, why, .. } => write!(f, "{name} ({origin}: {text:?}, {why})"),
            Unseen::Fact { what } => f.write_str(what),
        }
    }
}

impl Unseen {
    /// A variable's name, for a variable.
    pub fn variable(&self) -> Option<&str> {
        match self {
            Unseen::Variable { name, .. } => Some(name),
            Unseen::Fact { .. } => None,
        }
    }
}
