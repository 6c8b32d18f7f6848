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
        self.assertIn("UPWARD: wire::auth (bottom) imports agent (top)", out)

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
        self.assertIn("agent: crate::conn names no module file", out)


if __name__ == "__main__":
    unittest.main()
