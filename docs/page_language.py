"""MkDocs hook: pages under ``zh/`` are Chinese, so their ``<html>`` element says ``lang="zh"``.

mkdocs-material sets one language for the whole site (``theme.language``, English here); this rewrites the
attribute of the pages whose source sits under a language's folder, after Material has rendered them.
"""
from __future__ import annotations

import re

LANGUAGES = {"zh/": "zh"}  # source folder -> the language of its pages


def page_language(src_uri: str) -> str | None:
    return next((lang for folder, lang in LANGUAGES.items() if src_uri.startswith(folder)), None)


def on_post_page(output: str, page, config) -> str:
    lang = page_language(page.file.src_uri)
    if lang is None:
        return output
    return re.sub(r'<html lang="[^"]*"', f'<html lang="{lang}"', output, count=1)
