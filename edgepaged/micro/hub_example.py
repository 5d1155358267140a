# A smart-home hub asks the box whether to turn the heating on, from its sensor readings.
# Copy edgepaged_micro.py and this file to the board (e.g. `mpremote cp edgepaged_micro.py
# hub_example.py :`) and set SERVER below to your box's address, or run it anywhere with
#     python hub_example.py HOST [PORT [TOKEN]]
import sys

import edgepaged_micro

SERVER = None   # on a board: the box running `edgepaged serve` (its address: `edgepaged ls`)

# what the hub's sensors say (on a real hub: read them here)
READINGS = {"room": "living room", "temperature_c": 17.5, "target_c": 20, "heating": "off", "window": "closed",
            "time": "22:30"}


def question(r):
    return ("It is %s. The %s is %.1f C, the target is %d C, the heating is %s and the window is %s. "
            "Should the heating be turned on? Answer yes or no, then give one short reason."
            % (r["time"], r["room"], r["temperature_c"], r["target_c"], r["heating"], r["window"]))


def decide(host, port=edgepaged_micro.DEFAULT_PORT, token=None):
    c = edgepaged_micro.Client(host, port, token=token, name="heating-hub", timeout=60)
    try:
        answer = c.ask(question(READINGS), system="You control a home's heating. Be brief.", max_tokens=48)
    finally:
        c.close()
    turn_on = answer.strip().lower().startswith("yes")
    return turn_on, answer


def main():
    argv = getattr(sys, "argv", [])
    host = argv[1] if len(argv) > 1 else SERVER
    if not host:
        print("usage: hub_example.py HOST [PORT [TOKEN]]  (or set SERVER in this file to the box's address)")
        sys.exit(2)
    port = int(argv[2]) if len(argv) > 2 else edgepaged_micro.DEFAULT_PORT
    token = argv[3] if len(argv) > 3 else None
    try:
        turn_on, answer = decide(host, port, token)
    except edgepaged_micro.ServerError as e:
        print("hub:", e)
        sys.exit(1)
    print("box says:", answer.strip())
    print("heating:", "ON" if turn_on else "stays off")


if __name__ == "__main__":
    main()
