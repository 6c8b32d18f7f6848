//! Node names as Slurm writes host lists: folded for reports
//! (`node[003-007,019]`) and expanded from an allocation's list
//! (`SLURM_JOB_NODELIST`), and sorted as people read them. A leaf.

use std::collections::{BTreeMap, BTreeSet};

/// The most nodes a fleet holds: the captures one check reads, the names
/// one host list expands to.
pub const MAX_NODES: usize = 100_000;

/// `node003`, `node004` ... as `(prefix, number, width)` for folding.
fn split_number(name: &str) -> Option<(&str, u64, usize)> {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    if digits == 0 || digits > 18 {
        return None;
    }
    let (prefix, num) = name.split_at(name.len() - digits);
    Some((prefix, num.parse().ok()?, digits))
}

/// A name's sort key: `node9` before `node10`.
pub(super) fn natural(name: &str) -> (String, u64, String) {
    match split_number(name) {
        Some((p, n, _)) => (p.to_owned(), n, name.to_owned()),
        None => (name.to_owned(), 0, name.to_owned()),
    }
}

/// Folds node names as Slurm writes host lists: `node[003-007,019],gpu-a`.
pub fn fold_names(names: &[String]) -> String {
    let mut by_prefix: BTreeMap<(String, usize), BTreeSet<u64>> = BTreeMap::new();
    let mut plain: Vec<&str> = Vec::new();
    for n in names {
        match split_number(n) {
            Some((p, num, w)) => {
                by_prefix.entry((p.to_owned(), w)).or_default().insert(num);
            }
            None => plain.push(n),
        }
    }
    let mut out: Vec<String> = Vec::new();
    for ((prefix, width), nums) in by_prefix {
        let nums: Vec<u64> = nums.into_iter().collect();
        if nums.len() == 1 {
            out.push(format!("{prefix}{:0width$}", nums[0]));
            continue;
        }
        let mut ranges = Vec::new();
        let mut i = 0;
        while i < nums.len() {
            let mut j = i;
            while j + 1 < nums.len() && nums[j + 1] == nums[j] + 1 {
                j += 1;
            }
            ranges.push(if i == j { format!("{:0width$}", nums[i]) } else { format!("{:0width$}-{:0width$}", nums[i], nums[j]) });
            i = j + 1;
        }
        out.push(format!("{prefix}[{}]", ranges.join(",")));
    }
    out.extend(plain.into_iter().map(str::to_owned));
    out.join(",")
}


/// Expands a Slurm host list (`node[001-003,007],gpu-a[1-2]-ib,login`;
/// several brackets in one name multiply) into its names, in order,
/// without duplicates.
///
/// # Errors
/// A bracket not closed or nested, a range that runs backwards or is not
/// numbers, an empty name, or more than 100,000 names.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for item in split_top(list)? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        for name in expand_one(item)? {
            if seen.insert(name.clone()) {
                out.push(name);
            }
            if out.len() > MAX_NODES {
                return Err(format!("the host list names more than {MAX_NODES} nodes"));
            }
        }
    }
    if out.is_empty() {
        return Err(format!("the host list {list:?} names no node"));
    }
    Ok(out)
}

/// Splits at the commas outside brackets.
fn split_top(list: &str) -> Result<Vec<&str>, String> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("nested brackets in the host list {list:?}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("a ']' without its '[' in the host list {list:?}")),
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("a '[' not closed in the host list {list:?}"));
    }
    parts.push(&list[start..]);
    Ok(parts)
}

/// One item's names: each bracket's numbers (zero-padded to the width
/// written) in turn, the brackets multiplied left to right.
fn expand_one(item: &str) -> Result<Vec<String>, String> {
    let Some(open) = item.find('[') else { return Ok(vec![item.to_owned()]) };
    let close = open + item[open..].find(']').ok_or_else(|| format!("a '[' not closed in {item:?}"))?;
    let (prefix, inner, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let tails = expand_one(rest)?;
    let mut out = Vec::new();
    for part in inner.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let bad = || format!("{part:?} in {item:?} is not a number or a range of numbers (001-016)");
        if lo.is_empty() || !lo.bytes().all(|b| b.is_ascii_digit()) || !hi.bytes().all(|b| b.is_ascii_digit()) || hi.is_empty() || lo.len() > 18 || hi.len() > 18 {
            return Err(bad());
        }
        let (a, b): (u64, u64) = (lo.parse().map_err(|_| bad())?, hi.parse().map_err(|_| bad())?);
        if b < a {
            return Err(format!("the range {part:?} in {item:?} runs backwards"));
        }
        if (b - a) as usize >= MAX_NODES || out.len() + (b - a) as usize * tails.len().max(1) > MAX_NODES {
            return Err(format!("the host list names more than {MAX_NODES} nodes"));
        }
        let width = lo.len();
        for n in a..=b {
            for t in &tails {
                out.push(format!("{prefix}{n:0width$}{t}"));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_lists_expand_as_slurm_writes_them_and_fold_back() {
        let names = expand_hostlist("node[001-003,007],gpu-a[1-2]-ib,login").unwrap();
        assert_eq!(names, ["node001", "node002", "node003", "node007", "gpu-a1-ib", "gpu-a2-ib", "login"]);
        assert_eq!(expand_hostlist("r[1-2]n[01-02]").unwrap(), ["r1n01", "r1n02", "r2n01", "r2n02"]);
        assert_eq!(expand_hostlist("a,a,b").unwrap(), ["a", "b"], "without duplicates");
        let folded = fold_names(&expand_hostlist("node[001-064]").unwrap());
        assert_eq!(folded, "node[001-064]");
        for bad in ["", ",", "node[1-", "node[3-1]", "node[a-b]", "n[[1]]", "n]", "node[1-99999999]", "node[-3]"] {
            assert!(expand_hostlist(bad).is_err(), "{bad:?}");
        }
    }
}
