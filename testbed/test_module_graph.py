"""Tests of testbed/module-graph itself: a clean tree passes; a planted
upward import, a circle, an unlisted module and a path that names no
module file each fail, naming what they found."""
import os
import subprocess
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "module-graph")

LAYERS = """# a page

```layers {src}
bottom: wire
middle: peers
top: agent
```
"""


class ModuleGraph(unittest.TestCase):
    def tree(self, files):
        d = tempfile.mkdtemp()
        src = os.path.join(d, "src")
        for rel, text in files.items():
            path = os.path.join(src, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        doc = os.path.join(d, "arch.md")
        with open(doc, "w") as f:
            f.write(LAYERS.format(src=src))
        return src, doc

    def run_on(self, files):
        src, doc = self.tree(files)
        p = subprocess.run([TOOL, "--layers", doc, src], capture_output=True, text=True)
        return p.returncode, p.stdout

    def clean(self):
        return {
            "lib.rs": "mod agent;\nmod peers;\nmod wire;\npub use agent::Agent;\n",
            "wire/mod.rs": "pub(crate) mod auth;\n",
            "wire/auth.rs": "pub struct Key;\n",
            "peers/mod.rs": "pub(crate) mod conn;\n",
            "peers/conn.rs": "use crate::wire::auth::Key;\n#[cfg(test)]\nmod tests {\n    use crate::agent::Agent;\n}\n",
            "agent.rs": "use crate::peers::conn;\nuse crate::wire::auth::Key;\npub struct Agent;\n",
        }

    def test_a_layered_tree_passes(self):
        rc, out = self.run_on(self.clean())
        self.assertEqual(rc, 0, out)
        self.assertIn("agent -> peers::conn, wire::auth", out)

    def test_a_planted_upward_import_fails_naming_it(self):
        files = self.clean()
        files["wire/auth.rs"] = "use crate::peers::conn;\npub struct Key;\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)
        self.assertIn("UPWARD: wire::auth (bottom) imports peers::conn (middle)", out)

    def test_an_upward_import_through_super_fails(self):
        files = self.clean()
        files["wire/auth.rs"] = "use super::super::agent::Agent;\npub struct Key;\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)
        self.assertIn("UPWARD: wire::auth (bottom) imports agent (top)", out)

    def test_an_upward_import_inside_a_use_group_fails(self):
        # `use crate::{a, b::{c, d}}` names each module it reaches.
        files = self.clean()
        files["wire/auth.rs"] = "use crate::{wire, peers::{self, conn::Pool}};\npub struct Key;\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)
        self.assertIn("UPWARD: wire::auth (bottom) imports peers::conn (middle)", out)
        self.assertIn("UPWARD: wire::auth (bottom) imports peers (middle)", out)

    def test_an_upward_import_from_an_inline_module_that_is_not_a_test_fails(self):
        files = self.clean()
        files["wire/auth.rs"] = "pub struct Key;\nmod helpers {\n    use crate::agent::Agent;\n}\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)
        self.assertIn("UPWARD: wire::auth::helpers (bottom) imports agent (top)", out)

    def test_a_tree_without_a_layer_list_fails(self):
        src, doc = self.tree(self.clean())
        with open(doc, "w") as f:
            f.write("# a page without lists\n")
        p = subprocess.run([TOOL, "--layers", doc, src], capture_output=True, text=True)
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn("lists no layers for", p.stdout)

    def test_a_circle_fails(self):
        files = self.clean()
        files["peers/conn.rs"] = "use crate::peers::other::X;\n"
        files["peers/mod.rs"] = "pub(crate) mod conn;\npub(crate) mod other;\n"
        files["peers/other.rs"] = "use super::conn::Y;\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)
        self.assertIn("CIRCLE (2 modules): peers::conn peers::other", out)

    def test_a_module_in_no_layer_fails(self):
        files = self.clean()
        files["lib.rs"] += "mod stray;\n"
        files["stray.rs"] = "pub struct S;\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)
        self.assertIn("LAYERS: stray is in no layer", out)

    def test_a_module_rebound_under_another_name_fails(self):
        files = self.clean()
        files["lib.rs"] += "use peers::conn;\n"
        files["agent.rs"] = "use crate::conn::Pool;\npub struct Agent;\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)
        self.assertIn("agent: crate::conn::Pool goes through conn, the module peers::conn rebound under another path", out)



class ModuleGraphAttacks(unittest.TestCase):
    """Hostile review: Rust forms that import upward (or rebind) which the
    checker must not pass, and text that is not an import which it must
    not count. Each test states what a sound checker does."""

    tree = ModuleGraph.tree
    run_on = ModuleGraph.run_on
    clean = ModuleGraph.clean

    def upward(self, files, want="UPWARD: wire::auth (bottom) imports agent (top)"):
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)
        self.assertIn(want, out)

    def test_attack_spaces_around_the_path_separator(self):
        # `crate :: agent` is the same path to rustc.
        files = self.clean()
        files["wire/auth.rs"] = "use crate :: agent :: Agent;\npub struct Key;\n"
        self.upward(files)

    def test_attack_an_item_reexported_at_the_crate_root(self):
        # lib.rs has `pub use agent::Agent;`: `crate::Agent` is agent's item.
        files = self.clean()
        files["wire/auth.rs"] = "use crate::Agent;\npub struct Key;\n"
        self.upward(files)

    def test_attack_a_root_reexport_reached_through_super(self):
        files = self.clean()
        files["wire/auth.rs"] = "use super::super::Agent;\npub struct Key;\n"
        self.upward(files)

    def test_attack_a_raw_identifier_segment(self):
        files = self.clean()
        files["wire/auth.rs"] = "use crate::r#agent::Agent;\npub struct Key;\n"
        self.upward(files)

    def test_attack_a_block_comment_inside_a_use_tree(self):
        files = self.clean()
        files["wire/auth.rs"] = "use crate::{/* the top */ agent::Agent};\npub struct Key;\n"
        self.upward(files)

    def test_attack_the_crate_renamed_by_extern_crate_self(self):
        files = self.clean()
        files["lib.rs"] = "extern crate self as me;\n" + files["lib.rs"]
        files["wire/auth.rs"] = "use me::agent::Agent;\npub struct Key;\n"
        self.upward(files)

    def test_attack_an_import_in_a_file_pulled_in_by_include(self):
        files = self.clean()
        files["wire/auth.rs"] = 'include!("auth_body.in");\npub struct Key;\n'
        files["wire/auth_body.in"] = "use crate::agent::Agent;\n"
        # What it cannot read, it refuses (never a pass for what it did not see).
        self.upward(files, "wire::auth: include! of Rust text the checker does not read")

    def test_attack_a_module_file_placed_by_a_path_attribute(self):
        # wire::codec's file sits in agent/, so the checker files it under
        # the top layer: its import of peers (wire importing upward) passes.
        files = self.clean()
        files["wire/mod.rs"] = 'pub(crate) mod auth;\n#[path = "../agent/codec.rs"]\npub(crate) mod codec;\n'
        files["agent/codec.rs"] = "use crate::peers::conn;\npub struct Codec;\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)
        self.assertIn("UPWARD: wire::codec (bottom) imports peers::conn (middle)", out)

    def test_attack_a_brace_in_a_char_literal_of_a_test_module(self):
        # Stripping `#[cfg(test)] mod tests { ... }` counts braces in a
        # char literal: the rest of the file (a real upward import) is
        # stripped with it.
        files = self.clean()
        files["wire/auth.rs"] = (
            "pub struct Key;\n#[cfg(test)]\nmod tests {\n    const OPEN: char = '{';\n}\n"
            "use crate::agent::Agent;\n"
        )
        self.upward(files)

    def test_attack_a_production_module_named_like_a_test(self):
        # Not behind cfg(test): compiled into the library, yet never
        # checked, and what imports it is never flagged.
        files = self.clean()
        files["wire/mod.rs"] = "pub(crate) mod auth;\npub(crate) mod load_tests;\n"
        files["wire/load_tests.rs"] = "pub use crate::agent::Agent;\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)
        self.assertIn("UPWARD: wire::load_tests (bottom) imports agent (top)", out)

    def test_attack_a_rebinding_imported_by_its_own_name(self):
        # The checker says a path through a rebinding fails; importing the
        # rebinding itself (`use crate::top;`, then `top::Agent`) passes.
        files = self.clean()
        files["lib.rs"] += "pub(crate) use agent as top;\n"
        files["wire/auth.rs"] = "use crate::top;\npub struct Key(top::Agent);\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)

    def test_attack_a_rebinding_reached_through_super(self):
        files = self.clean()
        files["lib.rs"] += "pub(crate) use agent as top;\n"
        files["wire/auth.rs"] = "use super::super::top::Agent;\npub struct Key;\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 1, out)

    def test_attack_a_module_listed_in_two_layers(self):
        # A self-contradicting list: the last listing wins, silently, and
        # wire's import of agent is no longer upward.
        files = self.clean()
        files["peers/conn.rs"] = "pub struct Pool;\n"
        files["agent.rs"] = "use crate::peers::conn;\npub struct Agent;\n"
        files["wire/auth.rs"] = "use crate::agent::Agent;\npub struct Key;\n"
        src, doc = self.tree(files)
        with open(doc, "w") as f:
            f.write(f"```layers {src}\nbottom: wire\nmiddle: peers\ntop: agent wire\n```\n")
        p = subprocess.run([TOOL, "--layers", doc, src], capture_output=True, text=True)
        self.assertEqual(p.returncode, 1, p.stdout)

    def test_attack_false_positive_a_string_literal_naming_a_path(self):
        files = self.clean()
        files["wire/auth.rs"] = 'pub const HELP: &str = "see crate::agent::Agent";\npub struct Key;\n'
        rc, out = self.run_on(files)
        self.assertEqual(rc, 0, out)

    def test_attack_false_positive_a_block_comment_naming_a_path(self):
        files = self.clean()
        files["wire/auth.rs"] = "/* Used by crate::agent::Agent. */\npub struct Key;\n"
        rc, out = self.run_on(files)
        self.assertEqual(rc, 0, out)

    def test_held_a_path_inside_a_macro_body(self):
        files = self.clean()
        files["wire/auth.rs"] = "macro_rules! up { () => { $crate::agent::Agent } }\npub struct Key;\n"
        self.upward(files)

    def test_held_a_multi_line_use_tree_with_line_comments(self):
        files = self.clean()
        files["wire/auth.rs"] = "use crate::{\n    // the pool\n    peers::conn, // here\n    agent::Agent,\n};\npub struct Key;\n"
        self.upward(files)


if __name__ == "__main__":
    unittest.main()
