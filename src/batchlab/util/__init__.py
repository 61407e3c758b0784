"""The bottom layer: pure-Python helpers every package may use, importing nothing else of batchlab.

    errors     ConfigError (field, message): a user error, printed as one line, exit code 2
    units      display-only formatting (figures stay bytes and seconds inside)
    text       user text escaped for each renderer: rich markup, matplotlib mathtext, Markdown, HTML
    files      all-or-nothing file writes (temporary file in the same folder, then rename)
    lifeline   child processes: started without the working directory on sys.path, and they die with batchlab
"""
