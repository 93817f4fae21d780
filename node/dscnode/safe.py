"""What may reach a command line on the nodes, defined once for the plan (which refuses anything
else) and the node helper (which resolves and checks again before it runs): the characters
DeepSpeed's pdsh runner passes unquoted, and the resume argument `{latest:GLOB}`.

Matched against the whole string (fullmatch): `$` would take a trailing newline, which DeepSpeed's
runner passes unquoted, a second command on every node."""
import re

# Values and arguments DeepSpeed's runner puts on the remote command line unquoted; anything else
# it double-quotes, where $() and backticks still expand.
SHELL_SAFE = re.compile(r"[\w@%+=:,./-]*")
# A resume argument the supervisor replaces with the newest path matching GLOB: a relative glob
# (no leading '/', no '..'), resolved inside the run's working directory only.
LATEST = re.compile(r"\{latest:([\w@%+=:,.*?-][\w@%+=:,./*?-]*)\}")


def latest_glob(arg):
    """The glob of a `{latest:GLOB}` argument, or None where the argument is not one, or its glob
    could leave the working directory ('..')."""
    m = LATEST.fullmatch(str(arg))
    return m.group(1) if m and ".." not in m.group(1).split("/") else None
