"""The chat-template sandbox: a child process (this file, run by path with `python -I`, importing nothing of
anectypes) that renders chat templates in jinja2's ImmutableSandboxedEnvironment, as transformers renders
them, under limits the template cannot reach: the kernel's (RLIMIT_AS for memory; SIGALRM, whose default
action ends the process, for time), whatever the template runs, Python or C. One JSON request a line on
stdin ({"template", "context"}), one JSON reply a line on stdout: {"text"} or {"error"} (docs/generation.md).
"""

import datetime
import json
import resource
import signal
import sys

SECONDS = 2           # one rendering's wall-clock limit (a real template takes milliseconds)
MEMORY = 1 << 30      # the process's address space, bytes (Linux enforces it; macOS ignores RLIMIT_AS)
OUTPUT = 1 << 22      # the characters of one rendering


def environment():
    """jinja2's immutable sandbox with transformers' additions: loop controls, {% generation %},
    raise_exception, tojson and strftime_now."""
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):     # {% generation %}: transformers' assistant-mask tag
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda form: datetime.datetime.now().strftime(form))
    return env


def render(env, compiled, template, context):
    """The reply to one request."""
    import jinja2
    try:
        if template not in compiled:
            compiled.clear()                     # one template at a time is what a run renders
            compiled[template] = env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        return {"error": f"its chat template does not parse ({e})"}
    except RecursionError:
        return {"error": "its chat template nests too deep to parse (Python's recursion limit)"}
    try:
        text = compiled[template].render(**context)
    except MemoryError:
        return {"error": f"its chat template went over the memory limit ({MEMORY >> 20} MiB)"}
    except RecursionError:
        return {"error": "its chat template recursed past Python's recursion limit"}
    except Exception as e:      # the template's raise_exception, a sandbox refusal, or its code failing
        return {"error": f"the chat template refused the conversation: {type(e).__name__}: {str(e)[:300]}"}
    if len(text) > OUTPUT:
        return {"error": f"its chat template went over the output limit ({OUTPUT:,} characters)"}
    return {"text": text}


def main():
    try:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    except (ValueError, OSError):       # a lower hard limit already: it bounds the sandbox anyway
        pass
    env, compiled = environment(), {}
    for line in sys.stdin:
        request = json.loads(line)
        signal.setitimer(signal.ITIMER_REAL, SECONDS)       # SIGALRM's default action: the process ends
        reply = render(env, compiled, request["template"], request["context"])
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
