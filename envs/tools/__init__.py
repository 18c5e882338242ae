"""Tools agents call: the Tool protocol, its contract check and the built-in tools by name
(`base`: Tool, check_tool_class, TOOLS), the in-process `calculator` and `screenshot` (an
image of the task's toy screen), and the tools that work in the trajectory's sandbox
(`sandbox_tools`: bash, python, read_file, write_file, str_replace, run_tests, submit)."""
