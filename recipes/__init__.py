"""Recipe sets and the scripts that run them; a package so that scripts share `recipes.run`'s step helpers."""
