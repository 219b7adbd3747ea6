"""TileLang kernel definitions: one file per kernel, each exposing ``build_<op>(...)`` -> prim_func."""
